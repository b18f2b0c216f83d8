"""Tokens off the coordinator (docs/scaling.md): with --token-report-every N, decode and unified workers
stream tokens straight to a client's token sink and report to the coordinator only every N tokens.
Real processes; the streamed tokens and the RESULT both equal HF generate's."""

from __future__ import annotations

import asyncio
import time

import pytest

from mserve.coordinator.client import AsyncClient, Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected
from tests.helpers import chat, request_mix

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
EVERY = 8


async def stream_all(address: str, requests) -> tuple[list[list[int]], list]:
    """Every request at once through one AsyncClient with a token sink."""
    async with AsyncClient(address, timeout_s=120, direct_tokens=True, poll_interval_s=0.01) as client:
        async def one(text, images):
            async with client.stream(chat(text, images), max_tokens=MAX_TOKENS, ignore_eos=True) as s:
                chunks = [ids async for ids in s.chunks()]
            return chunks, s.result
        done = await asyncio.gather(*[one(text, images) for text, images in requests])
    return [c for c, _ in done], [r for _, r in done]


@pytest.mark.parametrize("arch, pools", [
    ("llava", {"encode": 1, "prefill": 1, "decode": 1}),
    ("qwen2_vl", {"encode": 0, "prefill": 0, "decode": 0, "unified": 1}),
], ids=["llava-1e1p1d", "qwen-unified"])
def test_tokens_reach_the_client_from_the_worker(tiny_model_dirs, arch, pools):
    model = str(tiny_model_dirs[arch])
    requests = request_mix(6, seed=31)
    with LocalCluster(model, **pools, extra_coordinator_args=["--token-report-every", str(EVERY)]) as cluster:
        chunks, concurrent_results = asyncio.run(stream_all(cluster.address, requests))
        concurrent = [[t for chunk in c for t in chunk] for c in chunks]
        streamed, results = [], []
        with Client(cluster.address, timeout_s=120, direct_tokens=True) as c:
            for text, images in requests:
                with c.stream(chat(text, images), max_tokens=MAX_TOKENS, ignore_eos=True) as s:
                    streamed.append(list(s))
                results.append(s.result)
            worker = (cluster.worker_names("decode") or cluster.worker_names("unified"))[0]
            deadline = time.monotonic() + 30
            while True:  # the worker's counters arrive with its heartbeats
                status = c.status()
                direct = status["workers"][worker]["counters"].get("tokens_direct", 0)
                if direct >= 2 * len(requests) * (MAX_TOKENS - 1) * 0.5 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    want = expected(model, requests, MAX_TOKENS, ignore_eos=True)
    assert streamed == want and [r.token_ids for r in results] == want
    assert concurrent == want and [r.token_ids for r in concurrent_results] == want
    # Each step's tokens arrived by themselves, not all at once with RESULT: the sink delivered them
    # (the coordinator relays none of them past the first).
    assert all(len(c) >= MAX_TOKENS // 2 for c in chunks), [len(c) for c in chunks]
    # The worker pushed the streams itself, a message per step: about one per token past the first.
    assert direct >= 2 * len(requests) * (MAX_TOKENS - 1) * 0.5
    # The coordinator heard each request's tokens only every EVERY of them (plus the first and last).
    assert status["stats"]["token_items"] <= 2 * len(requests) * (MAX_TOKENS // EVERY + 2)
