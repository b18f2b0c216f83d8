"""Video requests through real encode -> prefill -> decode clusters give exactly HF generate()'s tokens."""

from __future__ import annotations

import asyncio
import importlib.util
import io

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import AsyncClient
from tests.clusters import LLAVA_1E1P1D, QWEN2_VL_1E1P1D, family_1e1p1d
from tests.helpers import PROMPTS, chat, hf_generate, hf_generate_visual, make_frames, make_image, make_video_file

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def video_chat(text: str, frames: list[bytes]) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": text}]}]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


async def generate_all(address: str, conversations: list[list[dict]]):
    async with AsyncClient(address, timeout_s=120) as client:
        return await asyncio.gather(*[client.generate(m, max_tokens=MAX_TOKENS) for m in conversations])


@pytest.mark.parametrize("shared_cluster", [QWEN2_VL_1E1P1D], ids=str, indirect=True)
def test_qwen_video_and_image_1e1p1d(shared_cluster):
    model = shared_cluster.model
    frames, image = make_frames(120, 90, 3, seed=21), make_image(150, 100, seed=22)
    video_req, image_req = video_chat(PROMPTS[0], frames), chat(PROMPTS[1], [image])
    # A video file too, when PyAV is installed: probed by the coordinator, decoded by the encode worker.
    clip = make_video_file(make_frames(112, 84, 6, seed=24), fps=4) if importlib.util.find_spec("av") else None
    file_req = [video_chat(PROMPTS[4], clip)] if clip is not None else []
    video_res, image_res, *file_res = asyncio.run(generate_all(shared_cluster.address, [video_req, image_req] + file_req))
    (again,) = asyncio.run(generate_all(shared_cluster.address, [video_req]))
    builder = PromptBuilder(model)
    if clip is not None:
        from mserve.common.video import decode_video_file

        pp = builder.prepare(file_req[0])
        decoded = [png(f) for f in decode_video_file(clip, pp.images[0].indices)]
        assert len(decoded) == 3  # 1.5 s at 2 frames per second
        assert file_res[0].token_ids == hf_generate_visual(model, pp.prompt_ids, [decoded], MAX_TOKENS)
    video_pp = builder.prepare(video_req)
    assert video_res.token_ids == hf_generate_visual(model, video_pp.prompt_ids, [frames], MAX_TOKENS)
    assert image_res.token_ids == hf_generate(model, builder.prepare(image_req).prompt_ids, [image], MAX_TOKENS)
    assert video_res.visual_tokens == builder.family.video_token_count(video_pp.image_sizes[0]) == 24
    assert video_res.timings["encode_s"] > 0 and video_res.timings["transfer_s"] > 0
    assert again.token_ids == video_res.token_ids and again.cache_hits["embedding"] == 1  # the video's key hit


@pytest.mark.parametrize("shared_cluster", [family_1e1p1d("qwen2_5_vl")], ids=str, indirect=True)
def test_qwen2_5_video_timing_1e1p1d(shared_cluster):
    """Qwen2.5-VL: each video's frame rate travels from admission to the prefill worker's M-RoPE index (a
    frame list's own fps, and a file's sampled rate), next to an image in the same prompt."""
    model = shared_cluster.model
    frames, image = make_frames(120, 90, 4, seed=31), make_image(100, 150, seed=32)
    req = [{"role": "user", "content": [{"type": "image", "image": image},
                                        {"type": "video", "video": frames, "fps": 0.5},
                                        {"type": "text", "text": PROMPTS[3]}]}]
    clip = make_video_file(make_frames(112, 84, 6, seed=24), fps=4) if importlib.util.find_spec("av") else None
    file_req = [video_chat(PROMPTS[4], clip)] if clip is not None else []
    res, *file_res = asyncio.run(generate_all(shared_cluster.address, [req] + file_req))
    builder = PromptBuilder(model)
    pp = builder.prepare(req)
    meta = [{"total_num_frames": 4, "fps": 0.5}]
    assert res.token_ids == hf_generate_visual(model, pp.prompt_ids, [image, frames], MAX_TOKENS, meta)
    if clip is not None:
        from mserve.common.video import decode_video_file

        pp = builder.prepare(file_req[0])
        decoded = [png(f) for f in decode_video_file(clip, pp.images[0].indices)]
        meta = [{"total_num_frames": 6, "fps": 4.0, "frames_indices": list(pp.images[0].indices)}]
        assert file_res[0].token_ids == hf_generate_visual(model, pp.prompt_ids, [decoded], MAX_TOKENS, meta)


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], ids=str, indirect=True)
def test_llava_video_as_frames_1e1p1d(shared_cluster):
    model = shared_cluster.model
    frames = make_frames(100, 80, 4, seed=23)
    req = video_chat(PROMPTS[2], frames)
    (res,) = asyncio.run(generate_all(shared_cluster.address, [req]))
    pp = PromptBuilder(model).prepare(req)
    assert res.token_ids == hf_generate_visual(model, pp.prompt_ids, [frames], MAX_TOKENS)
    assert res.visual_tokens == 4 * 64
