"""Qwen3-VL's DeepStack features reach the right rows on every engine path (HF generate is the oracle).

The generic oracle (test_engine_oracle.py) runs Qwen3-VL through ragged batches, chunked prefill, prefix
hits and KV hand-off; these tests pin what is Qwen3-VL's own: a case where the DeepStack features change
the greedy tokens (so dropping or misplacing them would fail), prefilled in chunks that cut the image, and
after a prefix hit that ends inside the image; and its video (frame groups split by timestamp text, the
video's DeepStack features at its rows) in chunks, in a ragged batch, after a prefix hit and encoded elsewhere.
"""

from __future__ import annotations

import contextlib

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import (PROMPTS, _hf_generate, _hf_generate_visual, hf_generate, hf_generate_visual, make_frames,
                           make_image, reference_model)

MAX_NEW = 10


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])  # one tower and processor, two text models
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


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
    engine = Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 128, "block_size": 16, **config}))
    seq = engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    return engine.run_until_done()["r"], seq


def test_deepstack_changes_the_tokens_and_chunks_cutting_the_image_get_their_rows(model_dir, builder):
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    with deepstack_dropped(model_dir):  # hf_generate caches by its inputs: the uncached function here
        without = list(_hf_generate.__wrapped__(model_dir, tuple(pp.prompt_ids), tuple(pp.images), MAX_NEW, False)[0])
    assert without != expected  # not vacuous: the features move this prompt's greedy tokens
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    assert start % 8 and length > 8  # 8-token chunks start and end inside the image
    out, _ = run(model_dir, pp, max_num_batched_tokens=8)
    assert out == expected


def test_prefix_hit_ending_inside_the_image(model_dir, builder):
    image = make_image(200, 120, seed=2)
    first = builder.prepare_text(PROMPTS[1], [image])
    second = builder.prepare_text(PROMPTS[6], [image])
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=128, block_size=16))
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
    encoder = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=16, parts="vision"))
    (encoded,) = encoder.encode(pp.images)
    config = encoder.runner.model.config
    layers = len(config.vision_config.deepstack_visual_indexes)
    assert layers == 2 and encoded.embeds.shape == (pp.prompt_ids.count(config.image_token_id),
                                                    config.text_config.hidden_size * (1 + layers))
    prefill = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=64, parts="text"))
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


def video_prompt(builder: PromptBuilder, parts: list, text: str):
    return builder.prepare([{"role": "user", "content": parts + [{"type": "text", "text": text}]}])


def test_video_and_image_chunked_with_deepstack_at_the_video_rows(model_dir, builder):
    """A video (frame groups split by timestamp text, one M-RoPE grid per group) after an image, in 8-token
    chunks that cut the groups; the video's DeepStack features move the tokens (so they must land)."""
    image, frames = make_image(90, 120, seed=2), make_frames(120, 90, 5, seed=3)
    pp = video_prompt(builder, [{"type": "image", "image": image}, {"type": "video", "video": frames, "fps": 2.0}],
                      PROMPTS[0])
    runs = builder.family.image_spans(pp.prompt_ids)
    assert len(runs) == 1 + 3 and builder.tokenizer.decode(pp.prompt_ids).count(" seconds>") == 3
    expected = hf_generate_visual(model_dir, pp.prompt_ids, [image, frames], MAX_NEW)
    with deepstack_dropped(model_dir):
        without = list(_hf_generate_visual.__wrapped__(model_dir, tuple(pp.prompt_ids), (image, tuple(frames)), MAX_NEW)[0])
    assert without != expected
    assert run(model_dir, pp)[0] == expected
    assert run(model_dir, pp, max_num_batched_tokens=8)[0] == expected


def test_ragged_batch_of_video_image_and_text(model_dir, builder):
    frames = make_frames(96, 64, 4, seed=8)
    prompts = {"video": video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[2]),
               "image": builder.prepare_text(PROMPTS[3], [make_image(150, 100, seed=7)]),
               "text": builder.prepare_text(PROMPTS[4])}
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=128, block_size=16, max_num_batched_tokens=48))
    for rid, pp in prompts.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()
    assert out["video"] == hf_generate_visual(model_dir, prompts["video"].prompt_ids, [frames], MAX_NEW)
    assert out["image"] == hf_generate(model_dir, prompts["image"].prompt_ids, prompts["image"].images, MAX_NEW)
    assert out["text"] == hf_generate(model_dir, prompts["text"].prompt_ids, [], MAX_NEW)


def test_prefix_hit_inside_the_video_and_encoded_elsewhere(model_dir, builder):
    frames = make_frames(120, 90, 6, seed=4)
    first = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[1])
    second = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[6])
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=128, block_size=16))
    engine.add_request("a", first.prompt_ids, images=first.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    engine.run_until_done()
    seq = engine.add_request("b", second.prompt_ids, images=second.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()["b"]
    runs = builder.family.image_spans(second.prompt_ids)
    assert runs[0][0] < seq.num_cached_tokens < runs[-1][0] + runs[-1][1]
    assert out == hf_generate_visual(model_dir, second.prompt_ids, [frames], MAX_NEW)
    # the disaggregated path: a vision-only engine encodes, a text-only engine prefills and decodes
    (encoded,) = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=16, parts="vision")).encode(second.images)
    assert encoded.grid_thw == builder.family.video_grid(second.image_sizes[0])
    prefill = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=64, parts="text"))
    prefill.add_request("r", second.prompt_ids, encoded=[encoded], sampling=SamplingParams(max_tokens=MAX_NEW))
    assert prefill.run_until_done()["r"] == out


def test_video_admission_counts_and_limits(builder):
    from mserve.coordinator.admission import AdmissionError, Limits, admit

    def request(frames, **part):
        content = [{"type": "video", "video": frames, **part}, {"type": "text", "text": "What happens?"}]
        return {"request_id": "x", "messages": [{"role": "user", "content": content}]}

    frames = make_frames(120, 90, 5, seed=1)
    admitted = admit(builder, Limits(), request(frames, fps=3.0))
    pp = video_prompt(builder, [{"type": "video", "video": frames, "fps": 3.0}], "What happens?")
    assert admitted.prompt_ids == pp.prompt_ids
    assert admitted.images[0].num_tokens == pp.prompt_ids.count(builder.family.video_token_id)
    with pytest.raises(AdmissionError, match="video 0 has 5 frames, over the limit max_video_frames=4"):
        admit(builder, Limits(max_video_frames=4), request(frames))
    with pytest.raises(AdmissionError, match="over the limit max_image_pixels=10000"):
        admit(builder, Limits(max_image_pixels=100 * 100), request(frames))
    with pytest.raises(AdmissionError, match="video 0: Qwen3-VL needs at least temporal_patch_size=2 frames"):
        admit(builder, Limits(), request(frames[:1]))


def test_video_file_sampled_by_its_processor_rule(model_dir, builder):
    """A 4 fps file of 9 frames: the coordinator's sampling (the video processor's linspace, 4 frames) is
    what the encode worker decodes, and the tokens are HF's on those frames."""
    import io

    from mserve.common.video import decode_video_file
    from tests.helpers import make_video_file

    pytest.importorskip("av")
    data = make_video_file(make_frames(112, 84, 9, seed=5), fps=4)
    pp = video_prompt(builder, [{"type": "video", "video": data}], PROMPTS[5])
    assert pp.images[0].indices == (0, 3, 5, 8)
    frames = []
    for image in decode_video_file(data, pp.images[0].indices):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        frames.append(buf.getvalue())
    assert run(model_dir, pp)[0] == hf_generate_visual(model_dir, pp.prompt_ids, [frames], MAX_NEW)
