"""Image prefetch for the encode role: decoded on threads, taken once, errors where a decode would raise them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from mserve.common.images import ImageError, decode_image
from mserve.workers.image_prefetch import ImagePrefetch
from tests.helpers import make_image


@dataclass
class Ref:
    hash: str
    data: bytes


def test_prefetched_images_equal_a_decode_on_the_spot_and_run_on_other_threads():
    threads = []

    def decode(ref: Ref):
        threads.append(threading.current_thread().name)
        return decode_image(ref.data, 10**7)

    refs = [Ref(f"h{i}", make_image(64 + 8 * i, 48, seed=i)) for i in range(4)]
    pre = ImagePrefetch(decode)
    try:
        pre.start(refs[:3] + refs[:1])  # a hash twice: decoded once
        assert len(pre) == 3
        got = [pre.take(r) for r in refs]  # the last was never started: decoded here
        assert len(pre) == 0
        for r, im in zip(refs, got):
            assert np.array_equal(np.asarray(im), np.asarray(decode_image(r.data, 10**7)))
        assert sum(name.startswith("image-decode") for name in threads) == 3
        assert threads.count(threading.current_thread().name) == 1  # the one never started
    finally:
        pre.close()


def test_a_bad_image_raises_at_take_and_keep_drops_the_rest():
    pre = ImagePrefetch(lambda ref: decode_image(ref.data, 10**7))
    try:
        bad, good = Ref("bad", b"not an image"), Ref("good", make_image(32, 32))
        pre.start([bad, good, Ref("other", make_image(16, 16, seed=3))])
        with pytest.raises(ImageError):
            pre.take(bad)
        pre.keep([good])
        assert len(pre) == 1 and pre.take(good).size == (32, 32)
    finally:
        pre.close()


def test_the_engine_encodes_an_image_decoded_ahead_as_it_would_decode_it(tiny_model_dirs):
    """The unified role's IO-thread decode (Engine.predecoded): taken once, the same embeddings."""
    import torch

    from mserve.common.video import visual_hash
    from mserve.workers.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(str(tiny_model_dirs["llava"]), dtype="float32"))
    image = make_image(96, 80, seed=4)
    want = engine.encode([image])[0].embeds
    h = visual_hash(image)
    # A different picture under the image's hash shows the engine used what was decoded ahead.
    engine.predecoded[h] = engine.decode_visual(make_image(96, 80, seed=5))
    got = engine.encode([image], [h])[0].embeds
    assert h not in engine.predecoded
    assert torch.equal(got, engine.encode([make_image(96, 80, seed=5)])[0].embeds) and not torch.equal(got, want)
    assert torch.equal(engine.encode([image], [h])[0].embeds, want)  # taken once: decoded from its bytes again


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_an_image_processed_ahead_embeds_as_on_the_loop(family, tiny_model_dirs):
    """The unified role runs the image processor on its IO thread too (ModelRunner.prepare_image): one
    image's vision forward takes that output as it is, with the loop's very embeddings; a batch of
    several processes them together again."""
    import torch

    from mserve.common.video import visual_hash
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.model_runner import PreparedImage

    engine = Engine(EngineConfig(str(tiny_model_dirs[family]), dtype="float32"))
    a, b = make_image(96, 80, seed=4), make_image(150, 60, seed=6)
    want = [e.embeds for e in engine.encode([a, b])]
    prepared = engine.runner.prepare_image(engine.decode_visual(a))
    assert isinstance(prepared, PreparedImage) and "pixel_values" in prepared.inputs
    engine.predecoded[visual_hash(a)] = prepared
    assert torch.equal(engine.encode([a], [visual_hash(a)])[0].embeds, engine.encode([a])[0].embeds)
    # the processed output is what runs: another image's under a's hash gives that image's embeddings
    engine.predecoded[visual_hash(a)] = engine.runner.prepare_image(engine.decode_visual(b))
    assert torch.equal(engine.encode([a], [visual_hash(a)])[0].embeds, engine.encode([b])[0].embeds)
    for h, im in ((visual_hash(a), a), (visual_hash(b), b)):
        engine.predecoded[h] = engine.runner.prepare_image(engine.decode_visual(im))
    got = engine.encode([a, b], [visual_hash(a), visual_hash(b)])
    assert all(torch.equal(g.embeds, w) for g, w in zip(got, want))
