"""The families beyond LLaVA-1.5 and Qwen2-VL through a real 1e1p1d cluster: exactly HF generate's tokens."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from mserve.common.model import load_family
from mserve.coordinator.client import AsyncClient
from mserve.coordinator.client_core import BadRequest
from tests.clusters import VIDEO_CHUNK, family_1e1p1d
from tests.coordinator.test_cluster import expected, generate_all
from tests.helpers import chat, make_frames, make_image, request_mix

pytestmark = pytest.mark.slow
# The last two have no code or tests here (tests/workers/untested_families.py): each worker proves the
# checkpoint at start (workers/probe.py; one probes, the others read its cached verdict) and the coordinator
# admits them through their processor's own count.
FAMILIES = ["llava_next", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm46v", "mistral3", "gemma3", "gemma4", "internvl", "smolvlm",
            "idefics3", "qwen3_5", "qwen3_5_moe", "llama4", "deepseek_vl", "llava_next_video"]


@pytest.fixture(scope="module", params=[family_1e1p1d(f) for f in FAMILIES], ids=FAMILIES)
def family_cluster(request, shared_clusters):
    """(model folder, cluster): one lean 1e1p1d cluster per family, shared by this module's tests (and by
    other modules' tests of the same family and pools: tests/clusters.py)."""
    cluster = shared_clusters.get(request.param)
    yield cluster.model, cluster
    shared_clusters.release(request.param)


def mix(model: str, n: int, seed: int) -> list[tuple[str, list[bytes]]]:
    """request_mix's requests; for a family served for text only (Llama 4), their text alone."""
    requests = request_mix(n, seed)
    return requests if load_family(model).takes_images else [(text, []) for text, _ in requests]


def test_text_image_and_multi_image_requests_match_hf(family_cluster):
    model, cluster = family_cluster
    requests = mix(model, 6, seed=11)  # text-only, one image, two images, of varied sizes
    if (why_no_image := load_family(model).image_unsupported()) is not None:  # Llama 4: a bad request naming why

        async def refused():
            async with AsyncClient(cluster.address, timeout_s=120) as client:
                with pytest.raises(BadRequest, match="image 0: model .+ takes no image input: " + re.escape(why_no_image)):
                    await client.generate(chat("Hi", [make_image(20, 20)]), max_tokens=4)

        asyncio.run(refused())
    results = asyncio.run(generate_all(cluster.address, requests))
    again = asyncio.run(generate_all(cluster.address, requests[1:3]))  # the same images again: cached
    for i, (res, exp) in enumerate(zip(results, expected(model, requests))):
        assert res.token_ids == exp, f"request {i} ({len(requests[i][1])} images): {res.token_ids} != {exp}"
    assert [r.token_ids for r in again] == [r.token_ids for r in results[1:3]]
    assert all(r.timings["encode_s"] > 0 for r, (_, ims) in zip(results, requests) if ims)
    if not load_family(model).tested:  # its workers proved it before READY: the verdict they wrote
        from mserve.workers.verdicts import cache_dir, verdict_key

        assert json.loads((cache_dir() / f"{verdict_key(model, 'float32')}.json").read_text())["served"]

        async def status():
            async with AsyncClient(cluster.address, timeout_s=30) as client:
                return await client.status()

        assert asyncio.run(status())["verification"] == "verified at load"  # mserve status and /v1/models show it


def test_bad_input_ends_with_an_error_naming_the_limit_or_family_and_the_cluster_goes_on(family_cluster):
    """Too many images (the coordinator's max_images_per_request, 8 by default), and a video to a family
    that takes none: each request ends with an explicit bad_request naming why; the next one is served."""
    model, cluster = family_cluster
    why_no_video = load_family(model).video_unsupported()
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]

    async def run():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            with pytest.raises(BadRequest, match="9 images is over the limit max_images_per_request=8"):
                await client.generate(chat("Hi", [make_image(20, 20, seed=i) for i in range(9)]), max_tokens=4)
            if why_no_video is not None:
                with pytest.raises(BadRequest, match=re.escape(f"video 0: {why_no_video}")):
                    await client.generate(video, max_tokens=4)
            return await generate_all(cluster.address, mix(model, 2, seed=3))

    after = asyncio.run(run())
    assert [r.token_ids for r in after] == expected(model, mix(model, 2, seed=3))


def test_timestamped_video_with_a_prefix_hit_and_chunked_prefill(family_cluster):
    """Qwen3-VL's video (timestamped frame groups, DeepStack at the video rows) with an image, prefilled in
    chunks; the same video under another question then hits the prefix cache. The coordinator's visual
    token count is its processor's (tests/common/test_qwen3_vl_video.py) and the tokens are HF's."""
    model, cluster = family_cluster
    if not load_family(model).timestamped_video:
        pytest.skip("Qwen3-VL's own video path")
    from mserve.common.prompt import PromptBuilder
    from tests.helpers import PROMPTS, hf_generate_visual

    frames, image = make_frames(120, 90, 5, seed=41), make_image(90, 120, seed=42)

    def req(text: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "video", "video": frames, "fps": 2.0},
                                             {"type": "text", "text": text}]}]

    async def run():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            first = await client.generate(req(PROMPTS[0]), max_tokens=8)
            return first, await client.generate(req(PROMPTS[6]), max_tokens=8)

    first, second = asyncio.run(run())
    builder = PromptBuilder(model)
    for res, text in ((first, PROMPTS[0]), (second, PROMPTS[6])):
        pp = builder.prepare(req(text))
        assert len(pp.prompt_ids) > 2 * VIDEO_CHUNK
        assert res.token_ids == hf_generate_visual(model, pp.prompt_ids, [image, frames], 8)
        assert res.visual_tokens == sum(builder.family.visual_token_count(s) for s in pp.image_sizes)
    assert second.cache_hits["prefix_tokens"] >= 16


def test_a_hybrid_models_prefix_hit_through_1e1p1d(family_cluster):
    """Qwen3.5's prefill worker keeps its linear layers' state at a block boundary of each prompt: the same
    image prompt again hits the cached prefix there, resumes from the snapshot and answers HF's tokens."""
    model, cluster = family_cluster
    if not load_family(model).rules.honoured_traits & {"linear_attention"}:
        pytest.skip("a hybrid (linear-attention) family's prefix hit")
    from tests.clusters import settled_counters

    requests = request_mix(3, seed=21)[1:2]  # one image prompt
    before = settled_counters(cluster)
    first = asyncio.run(generate_all(cluster.address, requests))
    again = asyncio.run(generate_all(cluster.address, requests))
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == expected(model, requests)
    after = settled_counters(cluster)
    prefill = next(w for w in after if w.startswith("prefill"))
    gained = {k: after[prefill].get(k, 0) - before[prefill].get(k, 0) for k in ("prefix_hits", "state_snapshots_restored")}
    assert gained["prefix_hits"] >= 1 and gained["state_snapshots_restored"] >= 1, gained


def test_a_clip_an_image_and_text_in_one_request_through_1e1p1d(family_cluster):
    """Gemma 4 takes images and audio in one prompt: the clip admitted from its header, both encoded on the encode
    worker, transferred and scattered; HF's tokens; STATUS (and so /v1/models) lists audio beside images."""
    model, cluster = family_cluster
    family = load_family(model)
    if not {"image", "audio"} <= set(family.modalities):
        pytest.skip("a family that takes images and audio in one prompt")
    from mserve.common.prompt import PromptBuilder
    from tests.audio_clips import make_audio
    from tests.audio_references import MAX_NEW, gemma4_inputs as hf_inputs, gemma4_generate as hf_generate

    conversation = [{"role": "user", "content": [
        {"type": "audio", "audio": make_audio(20000, 22050, "mp3", seed=1)},
        {"type": "image", "image": make_image(120, 90)},
        {"type": "text", "text": "What do you hear and see?"}]}]

    async def run():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            return await client.generate(conversation, max_tokens=MAX_NEW), await client.status()

    res, status = asyncio.run(run())
    builder = PromptBuilder(model)
    assert res.token_ids == hf_generate(model, hf_inputs(builder, builder.prepare(conversation)))
    assert [m["modalities"] for m in status["models"].values()] == [["text", "image", "audio"]]
