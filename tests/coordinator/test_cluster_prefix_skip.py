"""Turn 2 of a conversation about an image does not encode it again when the cached prefix holds it, through
the unified role and 1e1p1d, and its tokens are HF generate's; a stale prefix index (blocks the prefill
worker no longer holds) costs a re-run that encodes the image, never a token."""

from __future__ import annotations

import asyncio

import pytest

from mserve.common.hashing import item_spans, prompt_block_hashes
from mserve.common.images import image_hash
from mserve.common.prompt import PromptBuilder
from mserve.common.redis_store import RedisStore
from mserve.coordinator.async_client import AsyncClient
from mserve.coordinator.launcher import LocalCluster
from tests.clusters import LLAVA_1E1P1D, LLAVA_UNIFIED, QWEN2_VL_1E1P1D, QWEN2_VL_UNIFIED, settled_counters
from tests.coordinator.test_cluster_caches import counters, wait_for
from tests.helpers import hf_generate, make_image

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Tell me a story about a small robot who learns to paint landscapes near the sea at dawn."


def conversation(image: bytes, reply: str | None = None) -> list[dict]:
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    if reply is None:
        return turn
    return turn + [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                   {"role": "user", "content": [{"type": "text", "text": "And what colour is the sea?"}]}]


def ask(cluster: LocalCluster, messages: list[dict]):
    async def go():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            return await client.generate(messages, max_tokens=MAX_TOKENS)
    return asyncio.run(go())


def hf_tokens(model: str, messages: list[dict], image: bytes) -> list[int]:
    return hf_generate(model, PromptBuilder(model).prepare(messages).prompt_ids, [image], MAX_TOKENS)


def added(cluster: LocalCluster, base: dict[str, dict], worker: str, name: str) -> int:
    """How much `name` grew on `worker` since `base` (settled_counters: the clusters are shared)."""
    return counters(cluster)[worker].get(name, 0) - base.get(worker, {}).get(name, 0)


def image_blocks(model: str, messages: list[dict], image: bytes) -> list[str]:
    """The prefix-index hashes of the prompt's full blocks up to the one holding the image's last token."""
    builder = PromptBuilder(model)
    ids = builder.prepare(messages).prompt_ids
    tokens = ids.count(builder.family.image_token_id)
    spans = item_spans(builder.family.image_spans(ids), [(image_hash(image), tokens)])
    last = len(ids) - 1 - ids[::-1].index(builder.family.image_token_id)
    return prompt_block_hashes(ids, 16, spans)[:last // 16 + 1]


def two_turns(cluster: LocalCluster, model: str, image: bytes, before_turn_two=lambda: None):
    first = ask(cluster, conversation(image))
    assert first.token_ids == hf_tokens(model, conversation(image), image)
    before_turn_two()
    messages = conversation(image, first.text)
    second = ask(cluster, messages)
    assert second.token_ids == hf_tokens(model, messages, image)
    return first, second


@pytest.mark.parametrize("shared_cluster", [LLAVA_UNIFIED, QWEN2_VL_UNIFIED], ids=["llava", "qwen2_vl"], indirect=True)
def test_unified_turn_two_skips_the_prefix_cached_image(shared_cluster):
    cluster, model = shared_cluster, shared_cluster.model
    base = settled_counters(cluster)
    image = make_image(200, 150, seed=21)
    first, second = two_turns(cluster, model, image)
    assert "skipped_by_prefix" not in first.cache_hits
    assert second.cache_hits["skipped_by_prefix"] == 1 and second.cache_hits["embedding"] == 0
    (worker,) = cluster.worker_names("unified")
    wait_for(lambda: added(cluster, base, worker, "encodes_skipped_by_prefix") == 1,
             what="the skip in the worker's counters")
    assert added(cluster, base, worker, "encoded_images") == 1

    # A new question on the same image in a new conversation: the prefix holds the image again.
    # The same image after a different prompt start is not in any prefix: L1 has its embeddings.
    other = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                         {"type": "text", "text": QUESTION}]}]
    third = ask(cluster, other)
    assert third.token_ids == hf_tokens(model, other, image)
    assert third.cache_hits["embedding"] == 1 and "skipped_by_prefix" not in third.cache_hits
    wait_for(lambda: added(cluster, base, worker, "embedding_l1_hits") == 1,
             what="the L1 hit in the worker's counters")
    assert added(cluster, base, worker, "encoded_images") == 1
    assert added(cluster, base, worker, "encodes_skipped_by_prefix") == 1


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D, QWEN2_VL_1E1P1D], ids=["llava", "qwen2_vl"], indirect=True)
def test_disaggregated_turn_two_skips_encode_and_fetch_and_a_stale_index_reruns(shared_cluster):
    cluster, model = shared_cluster, shared_cluster.model
    base = settled_counters(cluster)
    store = RedisStore(cluster.redis_url)
    (prefill,), (encoder,) = cluster.worker_names("prefill"), cluster.worker_names("encode")
    image = make_image(200, 150, seed=22)

    def indexed() -> None:  # the coordinator sees the prefill worker's blocks only through Redis
        blocks = image_blocks(model, conversation(image), image)
        wait_for(lambda: set(blocks) <= store.prefix_blocks_of(model, prefill), what="turn 1's blocks in the prefix index")
    first, second = two_turns(cluster, model, image, before_turn_two=indexed)
    assert second.cache_hits["skipped_by_prefix"] == 1 and second.cache_hits["embedding"] == 0
    assert second.attempts == 1
    wait_for(lambda: added(cluster, base, prefill, "encodes_skipped_by_prefix") == 1,
             what="the skip in the prefill worker's counters")
    # The encoder's counters reach STATUS with its own heartbeats, not with the prefill worker's: wait for them.
    wait_for(lambda: added(cluster, base, encoder, "encoded_images") >= 1, what="turn 1's encode in the encoder's counters")
    assert added(cluster, base, encoder, "encoded_images") == 1
    assert added(cluster, base, encoder, "embedding_cache_hits") == 0

    # A stale index: it claims the prefill worker holds a prompt it never saw (as after an eviction the
    # index has not heard of yet). The image is skipped, the prefill finds no blocks, and the re-run encodes.
    fresh = make_image(180, 140, seed=23)
    messages = conversation(fresh)
    ids = PromptBuilder(model).prepare(messages).prompt_ids
    family = PromptBuilder(model).family
    tokens = ids.count(family.image_token_id)
    spans = item_spans(family.image_spans(ids), [(image_hash(fresh), tokens)])
    store.update_prefix_blocks(model, prefill, prompt_block_hashes(ids, 16, spans), [])
    stale = ask(cluster, messages)
    assert stale.token_ids == hf_tokens(model, messages, fresh)
    assert stale.attempts == 2 and "skipped_by_prefix" not in stale.cache_hits
    # Each worker's counters arrive with its own heartbeat: wait for both reports.
    wait_for(lambda: added(cluster, base, encoder, "encoded_images") == 2
             and added(cluster, base, prefill, "prefix_skip_fallbacks") == 1,
             what="the re-run's encode and the prefill worker's fallback in their counters")
    assert added(cluster, base, prefill, "encodes_skipped_by_prefix") == 1
    assert added(cluster, base, prefill, "prefix_skip_fallbacks") == 1
    store.close()
