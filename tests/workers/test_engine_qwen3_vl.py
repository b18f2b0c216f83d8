"""Qwen3-VL's DeepStack features reach the right rows on every engine path (HF generate is the oracle).

The generic oracle (test_engine_oracle.py) runs Qwen3-VL through ragged batches, chunked prefill, prefix
hits and KV hand-off; these tests pin what is Qwen3-VL's own: a case where the DeepStack features change
the greedy tokens (so dropping or misplacing them would fail), prefilled in chunks that cut the image, and
after a prefix hit that ends inside the image.
"""

from __future__ import annotations

import contextlib

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, _hf_generate, hf_generate, make_frames, make_image, reference_model

MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen3_vl"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


@contextlib.contextmanager
def deepstack_dropped(model_dir: str):
    """HF's own model with its text model's DeepStack addition turned into a no-op."""
    text = reference_model(model_dir)[0].model.language_model
    text._deepstack_process = lambda hidden, mask, embeds: hidden
    try:
        yield
    finally:
        del text._deepstack_process


def run(model_dir: str, pp, **config) -> tuple[list[int], object]:
    engine = Engine(EngineConfig(model_dir, **{"num_blocks": 128, "block_size": 16, **config}))
    seq = engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    return engine.run_until_done()["r"], seq


def test_deepstack_changes_the_tokens_and_chunks_cutting_the_image_get_their_rows(model_dir, builder):
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    with deepstack_dropped(model_dir):  # hf_generate caches by its inputs: the uncached function here
        without = list(_hf_generate.__wrapped__(model_dir, tuple(pp.prompt_ids), tuple(pp.images), MAX_NEW, False))
    assert without != expected  # not vacuous: the features move this prompt's greedy tokens
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    assert start % 8 and length > 8  # 8-token chunks start and end inside the image
    out, _ = run(model_dir, pp, max_num_batched_tokens=8)
    assert out == expected


def test_prefix_hit_ending_inside_the_image(model_dir, builder):
    image = make_image(200, 120, seed=2)
    first = builder.prepare_text(PROMPTS[1], [image])
    second = builder.prepare_text(PROMPTS[6], [image])
    engine = Engine(EngineConfig(model_dir, num_blocks=128, block_size=16))
    engine.add_request("a", first.prompt_ids, images=first.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    engine.run_until_done()
    seq = engine.add_request("b", second.prompt_ids, images=second.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()["b"]
    (start, length), = builder.family.image_spans(second.prompt_ids)
    assert start < seq.num_cached_tokens < start + length  # the rest of the image is computed, with its features
    assert out == hf_generate(model_dir, second.prompt_ids, second.images, MAX_NEW)


def test_encoded_image_carries_its_deepstack_features_as_columns(model_dir, builder):
    """What the transfer and the caches move: [tokens, hidden * (1 + DeepStack layers)], and an encoder's
    output prefilled on a text-only engine gives HF's tokens."""
    pp = builder.prepare_text(PROMPTS[5], [make_image(150, 100, seed=7)])
    encoder = Engine(EngineConfig(model_dir, num_blocks=16, parts="vision"))
    (encoded,) = encoder.encode(pp.images)
    config = encoder.runner.model.config
    layers = len(config.vision_config.deepstack_visual_indexes)
    assert layers == 2 and encoded.embeds.shape == (pp.prompt_ids.count(config.image_token_id),
                                                    config.text_config.hidden_size * (1 + layers))
    prefill = Engine(EngineConfig(model_dir, num_blocks=64, parts="text"))
    prefill.add_request("r", pp.prompt_ids, encoded=[encoded], sampling=SamplingParams(max_tokens=MAX_NEW))
    assert prefill.run_until_done()["r"] == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)


def test_host_store_keeps_the_columns(tmp_path):
    import torch

    from mserve.common.transfer.host_store import HostEmbeddingStore

    store = HostEmbeddingStore(str(tmp_path), "qwen3", 2**20)
    packed = torch.randn(12, 64 * 3)
    store.put("k", packed, (1, 6, 8))
    got = store.get("k")
    assert torch.equal(got.embeds, packed) and got.grid_thw == (1, 6, 8)


def test_video_is_refused_at_admission_naming_the_family(builder):
    from mserve.coordinator.admission import AdmissionError, Limits, admit

    content = [{"type": "video", "video": make_frames(64, 64, 4)}, {"type": "text", "text": "What happens?"}]
    with pytest.raises(AdmissionError, match="video 0: video input is not supported for model_type qwen3_vl"):
        admit(builder, Limits(), {"request_id": "x", "messages": [{"role": "user", "content": content}]})
