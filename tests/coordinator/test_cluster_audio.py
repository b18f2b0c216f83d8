"""Qwen2-Audio through a real 1e1p1d cluster (tcp between the stages): audio clips are admitted from their
headers, encoded on the encode worker, transferred and scattered exactly as images, and the tokens are
HF generate's; bad audio ends with a bad_request naming the limit, and the cluster goes on serving."""

from __future__ import annotations

import asyncio

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import AsyncClient
from mserve.coordinator.client_core import BadRequest
from tests.audio_clips import make_audio
from tests.clusters import family_1e1p1d
from tests.audio_references import hf_generate_audio

pytestmark = pytest.mark.slow
MAX_NEW = 8


@pytest.fixture(scope="module")
def cluster(shared_clusters):
    lean = family_1e1p1d("qwen2_audio")
    yield shared_clusters.get(lean)
    shared_clusters.release(lean)


def turn(clips: list[bytes], text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "audio", "audio": c} for c in clips] + [{"type": "text", "text": text}]}]


async def _generate(address: str, conversations) -> list:
    async with AsyncClient(address, timeout_s=120) as client:
        return await asyncio.gather(*[client.generate(c, max_tokens=MAX_NEW) for c in conversations])


def test_clips_match_hf_and_a_repeated_clip_is_cached(cluster):
    model = cluster.model
    a, b = make_audio(20000, 22050, "mp3", seed=1), make_audio(30000, 44100, "flac", seed=3)
    conversations = [turn([a], "What is this sound?"), turn([a, b], "Compare them."),
                     turn([], "Say something."), turn([make_audio(8000, 16000, "wav", seed=4)], "Describe it.")]
    results = asyncio.run(_generate(cluster.address, conversations))
    builder = PromptBuilder(model)
    for i, (res, conv) in enumerate(zip(results, conversations)):
        assert res.token_ids == hf_generate_audio(model, builder.prepare(conv), MAX_NEW), f"request {i}"
    again = asyncio.run(_generate(cluster.address, [turn([b, a], "Compare them.")]))  # both clips cached now
    assert again[0].cache_hits["embedding"] == 2, again[0].cache_hits
    assert again[0].token_ids == hf_generate_audio(model, builder.prepare(turn([b, a], "Compare them.")), MAX_NEW)


def test_clips_through_a_media_store_match_hf_and_carry_no_bytes_inline(cluster):
    """Clips in the client's media store: admission counts them from the refs' header facts (sample rate,
    samples) by the model's rules, the encode worker pulls and checks them; HF generate's tokens, no byte
    through the coordinator, and a ref whose samples lie fails that request by the fact."""
    import dataclasses

    from mserve.common.media_store import MediaStore

    a, b = make_audio(20000, 22050, "mp3", seed=41), make_audio(12000, 16000, "wav", seed=42)
    conversations = [turn([a], "What is this sound?"), turn([a, b], "Compare them.")]

    async def run():
        with MediaStore() as store:
            async with AsyncClient(cluster.address, timeout_s=120, media_store=store) as client:
                before = (await client.status())["stats"]["media_bytes_inline"]
                results = [await client.generate(c, max_tokens=MAX_NEW) for c in conversations]
                lie = dataclasses.replace(store.put(b, "audio"), samples=6000)
                with pytest.raises(BadRequest, match="its samples is 12000, the request said samples=6000"):
                    await client.generate([{"role": "user", "content": [{"type": "audio", "media": lie.fields()},
                                                                        {"type": "text", "text": "?"}]}], max_tokens=2)
                after = (await client.status())["stats"]["media_bytes_inline"]
                return results, after - before, store.stats()["items"]

    results, inline, items = asyncio.run(run())
    builder = PromptBuilder(cluster.model)
    for i, (res, conv) in enumerate(zip(results, conversations)):
        assert res.token_ids == hf_generate_audio(cluster.model, builder.prepare(conv), MAX_NEW), f"request {i}"
    assert inline == 0 and items == 2


def test_a_unified_worker_serves_clips_exactly(shared_clusters, tiny_model_dirs):
    """The unified role: the clip decoded on its IO thread (workers/roles/unified.py), a repeat from its L1."""
    from tests.clusters import Lean

    lean = Lean("qwen2_audio", encode=0, prefill=0, decode=0, unified=1)
    unified = shared_clusters.get(lean)
    try:
        clip = make_audio(26000, 16000, "wav", seed=31)
        first, again = (asyncio.run(_generate(unified.address, [turn([clip], q)]))[0] for q in ("Hm?", "Hm, again?"))
        builder = PromptBuilder(unified.model)
        assert first.token_ids == hf_generate_audio(unified.model, builder.prepare(turn([clip], "Hm?")), MAX_NEW)
        assert again.token_ids == hf_generate_audio(unified.model, builder.prepare(turn([clip], "Hm, again?")), MAX_NEW)
        assert again.cache_hits["embedding"] == 1, again.cache_hits
    finally:
        shared_clusters.release(lean)


def test_bad_audio_is_refused_by_name_and_the_cluster_goes_on(cluster):
    clip = make_audio(16000, 16000, "wav")

    async def run():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            with pytest.raises(BadRequest, match="audio 0: truncated"):
                await client.generate(turn([clip[: len(clip) // 2]], "?"), max_tokens=4)
            with pytest.raises(BadRequest, match="too short for one audio token"):
                await client.generate(turn([make_audio(0, 16000, "wav")], "?"), max_tokens=4)
            return await client.generate(turn([clip], "And now?"), max_tokens=MAX_NEW)

    after = asyncio.run(run())
    assert after.token_ids == hf_generate_audio(cluster.model, PromptBuilder(cluster.model).prepare(turn([clip], "And now?")),
                                                MAX_NEW)


def test_turn_two_skips_the_prefix_cached_clip(cluster):
    """Turn 2 resends turn 1's clip: the prefill worker's cached prefix holds its placeholders, so the
    coordinator neither encodes nor fetches it (as for an image, tests/coordinator/test_cluster_prefix_skip.py)."""
    from mserve.common.hashing import item_spans, prompt_block_hashes
    from mserve.common.redis_store import RedisStore
    from mserve.common.video import visual_hash
    from tests.coordinator.test_cluster_caches import wait_for

    model, builder = cluster.model, PromptBuilder(cluster.model)
    question = "Tell me a story about the sound, the sea and a small robot who paints it at dawn."
    first_turn = turn([make_audio(24000, 16000, "wav", seed=12)], question)
    first = asyncio.run(_generate(cluster.address, [first_turn]))[0]
    pp = builder.prepare(first_turn)
    assert first.token_ids == hf_generate_audio(model, pp, MAX_NEW)
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    spans = item_spans([(start, length)], [(visual_hash(pp.images[0]), length)])
    blocks = prompt_block_hashes(pp.prompt_ids, 16, spans)[:(start + length - 1) // 16 + 1]
    store, (prefill,) = RedisStore(cluster.redis_url), cluster.worker_names("prefill")
    wait_for(lambda: set(blocks) <= store.prefix_blocks_of(model, prefill), what="turn 1's blocks in the prefix index")
    second_turn = first_turn + [{"role": "assistant", "content": [{"type": "text", "text": first.text}]},
                                {"role": "user", "content": [{"type": "text", "text": "And the colour of the sea?"}]}]
    second = asyncio.run(_generate(cluster.address, [second_turn]))[0]
    assert second.cache_hits.get("skipped_by_prefix") == 1 and second.cache_hits["embedding"] == 0, second.cache_hits
    assert second.token_ids == hf_generate_audio(model, builder.prepare(second_turn), MAX_NEW)


def test_the_official_openai_client_sends_input_audio_through_the_gateway(cluster):
    """OpenAI's input_audio part (and vLLM's audio_url) from the `openai` package, through the HTTP gateway:
    HF's tokens; /v1/models says the model takes text and audio; a bad clip is a 400 naming the limit."""
    import base64

    import httpx
    import openai

    url = cluster.start_gateway()  # stopped with the cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    a, b = make_audio(20000, 22050, "mp3", seed=21), make_audio(16000, 16000, "wav", seed=22)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(a).decode(), "format": "mp3"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(b).decode()}},
        {"type": "text", "text": "What are these sounds?"}]}]
    reply = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=MAX_NEW,
                                           extra_body={"return_token_ids": True})
    pp = PromptBuilder(cluster.model).prepare(turn([a, b], "What are these sounds?"))
    assert reply.choices[0].token_ids == hf_generate_audio(cluster.model, pp, MAX_NEW)
    assert reply.usage.prompt_tokens == len(pp.prompt_ids)
    (listed,) = [m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"] if m["id"] == cluster.model]
    assert listed["mserve_modalities"] == ["text", "audio"]
    with pytest.raises(openai.BadRequestError, match="too short for one audio token"):
        client.chat.completions.create(model=cluster.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(make_audio(100, 16000)).decode(),
                                                    "format": "wav"}}]}])


def test_voxtral_through_1e1p1d_matches_hf(shared_clusters):
    """Voxtral (its Tekken tokenizer's prompt, 30 s chunks) through the families' 1e1p1d cluster: one clip and
    two clips are HF's tokens, admission's counts are the processor's, and a repeated clip is an embedding hit."""
    from tests.audio_references import voxtral_generate as hf_generate

    lean = family_1e1p1d("voxtral")
    vox = shared_clusters.get(lean)
    try:
        a, b = make_audio(20000, 22050, "mp3", seed=41), make_audio(500000, 16000, "wav", seed=42)
        conversations = [turn([a], "What is this sound?"), turn([b, a], "Compare them.")]
        results = asyncio.run(_generate(vox.address, conversations))
        builder = PromptBuilder(vox.model)
        for i, (res, conv) in enumerate(zip(results, conversations)):
            expected = hf_generate(vox.model, builder.prepare(conv), conv[0]["content"][-1]["text"])
            assert res.token_ids == expected[:MAX_NEW], f"request {i}"
        again = asyncio.run(_generate(vox.address, [turn([a, b], "Again?")]))[0]  # both clips cached now
        assert again.cache_hits["embedding"] == 2, again.cache_hits
        assert again.token_ids == hf_generate(vox.model, builder.prepare(turn([a, b], "Again?")), "Again?")
    finally:
        shared_clusters.release(lean)
