"""Cache tiers in a real cluster: every hit path gives HF generate's tokens, and the indexes stay exact.

Two encoders share one host's L2 cache; L1 and L2 are sized for a couple of tiny images, so the
test walks through: a miss, an L1 hit with a prefix hit, a hit on the other encoder through L2
after the first one left, eviction from both tiers and a re-encode, and at the end the Redis
prefix index holding exactly the blocks the pools hold.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from mserve.common.images import image_hash
from mserve.common.prompt import PromptBuilder
from mserve.common.redis_store import RedisStore
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected, generate_all
from tests.helpers import hf_generate, make_image

pytestmark = pytest.mark.slow


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def workers(cluster: LocalCluster) -> dict[str, dict]:
    with Client(cluster.address, timeout_s=10) as c:
        return c.status()["workers"]


def counters(cluster: LocalCluster) -> dict[str, dict]:
    return {wid: w.get("counters", {}) for wid, w in workers(cluster).items()}


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_every_cache_tier_hit_is_exact_and_the_prefix_index_is_exact(tiny_model_dirs, redis_url, arch):
    model = str(tiny_model_dirs[arch])
    a, b, c, d = (make_image(112, 112, seed=s) for s in (11, 12, 13, 14))
    # Size L1 for two of these images and L2 for three (each embedding is visual tokens x hidden x fp32).
    builder = PromptBuilder(model)
    tokens = builder.prepare_text("x", [a]).prompt_ids.count(builder.family.image_token_id)
    cfg = json.loads((tiny_model_dirs[arch] / "config.json").read_text())
    entry_mb = (tokens * cfg.get("text_config", cfg)["hidden_size"] * 4 + 64) / 2**20
    with LocalCluster(model, encode=2, prefill=1, decode=1, redis_url=redis_url,
                      extra_worker_args=["--embedding-cache-mb", f"{2.5 * entry_mb:.6f}", "--host-embedding-cache-mb",
                                         f"{3.5 * entry_mb:.6f}", "--num-blocks", "64"],
                      # the same image leads every prompt: a prefix hit would skip the encode tiers tested here
                      extra_coordinator_args=["--prefix-skip", "off"]) as cluster:
        run = lambda reqs: asyncio.run(generate_all(cluster.address, reqs))  # noqa: E731
        store = RedisStore(cluster.redis_url)
        ask = ("Describe the picture in detail, please.", [a])
        first, second = run([ask])[0], run([ask])[0]
        assert first.cache_hits["embedding"] == 0 and second.cache_hits["embedding"] == 1
        assert second.cache_hits["prefix_tokens"] >= 16  # the prompt's blocks stayed on the prefill worker
        # The holder is the encoder that ran the vision forward. The second request may have gone to the
        # other one, which then found `a` in L2 (counted there) and holds it in its L1 too: so the holder
        # is not any L1 entry of the Redis index (an arbitrary pick failed this test under CI's load).
        encoders = cluster.worker_names("encode")
        assert store.lookup_embedding(model, image_hash(a))  # indexed: in an L1, and in the host's L2
        cs = wait_for(lambda: (cs := counters(cluster)) and any(cs[n].get("encoded_images", 0) for n in encoders) and cs,
                      what="the first encode in the counters")
        holder = next(n for n in encoders if cs[n].get("encoded_images", 0))
        other = next(n for n in encoders if n != holder)
        encoded_before = cs[other].get("encoded_images", 0)

        # The holder leaves; the other encoder finds the image in the host's L2 cache.
        cluster.kill_worker(holder, signal.SIGTERM)
        wait_for(lambda: not workers(cluster).get(holder, {}).get("alive"), what=f"{holder} to leave")
        third = run([("What colour dominates?", [a])])[0]
        assert third.cache_hits["embedding"] == 1
        seen = wait_for(lambda: (cs := counters(cluster)[other]).get("embedding_l2_hits", 0) >= 1 and cs,
                        what="the L2 hit in the survivor's counters (heartbeats carry them)")
        assert seen.get("encoded_images", 0) == encoded_before

        # New images push `a` out of both tiers: it is encoded again, and still exact.
        run([("Compare these.", [b, c]), ("And this one?", [d])])
        fourth = run([("What colour dominates?", [a])])[0]
        assert fourth.cache_hits["embedding"] == 0
        wait_for(lambda: counters(cluster)[other]["encoded_images"] >= encoded_before + 4, what="a re-encode")

        asks = [ask, ask, ("What colour dominates?", [a]), ("What colour dominates?", [a])]
        want = expected(model, asks)
        for i, res in enumerate([first, second, third, fourth]):
            assert res.token_ids == want[i], f"request {i}"

        # The prefix index says exactly what the pools hold, and the pools are drained.
        prefill = cluster.worker_names("prefill")[0]
        def indexed_equals_pool():
            cs = counters(cluster)
            held = {w: cs[w].get("indexed_blocks") for w in cluster.worker_names("prefill") + cluster.worker_names("decode")}
            return all(len(store.prefix_blocks_of(model, w)) == n for w, n in held.items()) and held[prefill]
        wait_for(indexed_equals_pool, what="the Redis prefix index to equal the pools")
        # Routing asked the Redis index (mserve_redis_*_lookups_total): the second request's image and prompt
        # were found there.
        with Client(cluster.address, timeout_s=10) as c:
            tele = c.status()["telemetry"]["counters"]
        assert tele["redis_embedding_lookups"] >= 4 and 1 <= tele["redis_embedding_lookup_hits"] < tele["redis_embedding_lookups"]
        assert tele["redis_prefix_lookups"] >= 4 and 1 <= tele["redis_prefix_lookup_hits"] <= tele["redis_prefix_lookups"]

        def drained() -> bool:  # counters come with heartbeats: wait for one after the last request
            cs = counters(cluster)
            return all(cs[w]["used_blocks"] == 0 and cs[w]["free_blocks"] == cs[w]["total_blocks"]
                       for w in cluster.worker_names("prefill") + cluster.worker_names("decode"))
        wait_for(drained, what="every KV pool to be drained (used 0, free == total)")
        store.close()


def test_kv_hand_back_gives_the_next_turn_the_reply_blocks_exactly(tiny_model_dirs, redis_url):
    """--kv-hand-back: decode hands turn 1's reply blocks to the prefill worker; turn 2 (which resends the
    reply) finds every block whose tokens match, and its answer equals HF generate on its own prompt."""
    model = str(tiny_model_dirs["llava"])
    image = make_image(112, 112, seed=21)
    q1 = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_url,
                      extra_coordinator_args=["--kv-hand-back"]) as cluster:
        with Client(cluster.address, timeout_s=120) as c:
            r1 = c.generate(q1, max_tokens=40, ignore_eos=True)
            prefill = cluster.worker_names("prefill")[0]
            wait_for(lambda: counters(cluster)[prefill].get("adopted_blocks", 0) > 0, what="the hand-back")
            q2 = q1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And the colours?"}]
            r2 = c.generate(q2, max_tokens=8)
    builder = PromptBuilder(model)
    p1, p2 = builder.prepare(q1), builder.prepare(q2)
    assert r2.token_ids == hf_generate(model, p2.prompt_ids, p2.images, 8)
    # Blocks the prefill worker holds: the prompt's full ones, then the reply's up to the last computed token.
    held = (len(p1.prompt_ids) + len(r1.token_ids) - 1) // 16
    sent = p1.prompt_ids + r1.token_ids
    same = next((i for i, (a, b) in enumerate(zip(p2.prompt_ids, sent)) if a != b), min(len(p2.prompt_ids), len(sent)))
    want = min(held, same // 16, (len(p2.prompt_ids) - 1) // 16) * 16
    assert r2.cache_hits["prefix_tokens"] == want >= len(p1.prompt_ids) // 16 * 16
