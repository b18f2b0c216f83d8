"""Tokens off the coordinator (docs/scaling.md): with --token-report-every N, decode and unified workers
stream tokens straight to a client's token sink and report to the coordinator only every N tokens.
Real processes; the streamed tokens and the RESULT both equal HF generate's. `check_direct_tokens`
also runs on the sharded cluster of test_cluster_shards.py (llava, encode / prefill / decode)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from mserve.common.cpu_placement import format_cpu_list
from mserve.coordinator.client import AsyncClient, Client
from mserve.coordinator.launcher import LocalCluster
from mserve.workers.fetcher import FETCH_THREADS
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


def check_direct_tokens(model: str, address: str, shard_addresses: list[str], worker: str) -> None:
    """Six requests streamed through AsyncClient (all at once) and then Client, both with a token sink:
    tokens arrive a step at a time from the worker, equal HF's and RESULT's, and the coordinators
    (summed over `shard_addresses`) hear only every EVERY-th of them."""
    def heard() -> int:  # token reports the coordinators took so far, summed over the shards
        total = 0
        for shard in shard_addresses:
            with Client(shard, timeout_s=30) as c:
                total += c.status()["stats"]["token_items"]
        return total

    requests = request_mix(6, seed=31)
    heard_before = heard()
    chunks, concurrent_results = asyncio.run(stream_all(address, requests))
    concurrent = [[t for chunk in c for t in chunk] for c in chunks]
    streamed, results = [], []
    with Client(address, timeout_s=120, direct_tokens=True) as c:
        for text, images in requests:
            with c.stream(chat(text, images), max_tokens=MAX_TOKENS, ignore_eos=True) as s:
                streamed.append(list(s))
            results.append(s.result)
    with Client(shard_addresses[0], timeout_s=30) as c:
        deadline = time.monotonic() + 30
        while True:  # the worker's counters arrive with its heartbeats
            direct = c.status()["workers"][worker]["counters"].get("tokens_direct", 0)
            if direct >= 2 * len(requests) * (MAX_TOKENS - 1) * 0.5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    token_items = heard() - heard_before
    want = expected(model, requests, MAX_TOKENS, ignore_eos=True)
    assert streamed == want and [r.token_ids for r in results] == want
    assert concurrent == want and [r.token_ids for r in concurrent_results] == want
    # The tokens arrived while the request ran, not all at once with RESULT: the sink delivered them (the
    # coordinator relays none of them past the first; the worker pushes that one too, so the stream
    # need not wait for the coordinator's relay: [24, 1, 1, 24, 1, 1] pieces on a CI host before it did).
    # How many pieces a stream comes in depends on how often this busy client's event loop ran (tokens
    # that arrived since are one piece: 8 pieces of 24 on a loaded CI host); that each step went out by
    # itself is the worker's count below.
    assert all(len(c) >= 2 for c in chunks), [len(c) for c in chunks]
    # The worker pushed the streams itself, a message per step: about one per token past the first.
    assert direct >= 2 * len(requests) * (MAX_TOKENS - 1) * 0.5
    # The coordinators heard each request's tokens only every EVERY of them (plus the first and last).
    assert token_items <= 2 * len(requests) * (MAX_TOKENS // EVERY + 2)


def thread_cores(pid: int) -> dict[int, tuple[str, str]]:
    """Every thread of a process: tid -> (its name, its Cpus_allowed_list)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out[int(tid)] = comm, next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
    return out


def test_tokens_reach_the_client_from_a_unified_worker(tiny_model_dirs):
    """Qwen2-VL on a unified worker; the disaggregated path (llava, two coordinator shards) is checked
    in test_cluster_shards.py on its cluster. This cluster is also CPU-placed (common/cpu_placement.py):
    the worker's model thread runs on its own core, and its IO threads (the fetch pool that decodes and
    processes images, the transfer server, the pulse, zmq's) on the coordinator's, where no model runs."""
    model = str(tiny_model_dirs["qwen2_vl"])
    with LocalCluster(model, encode=0, prefill=0, decode=0, unified=1, cpu_placement="auto",
                      extra_coordinator_args=["--token-report-every", str(EVERY)]) as cluster:
        check_direct_tokens(model, cluster.address, cluster.shard_addresses, cluster.worker_names("unified")[0])
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:  # one core: nothing is placed
            rest = format_cpu_list(cores[1:])
            assert cluster.placement.workers == {"unified-0": (cores[0],)} and cluster.placement.io == tuple(cores[1:])
            pid = cluster.processes["unified-0"].pid
            threads = thread_cores(pid)
            assert threads[pid][1] == str(cores[0])  # the loop: the model's core
            assert {c for name, c in threads.values() if name.startswith("ZMQbg/")} == {rest}
            assert {c for _, c in threads.values()} == {str(cores[0]), rest}
            assert sum(c == rest for _, c in threads.values()) >= FETCH_THREADS + 3  # + transfer, pulse, zmq IO
            assert {c for _, c in thread_cores(cluster.processes["coordinator"].pid).values()} == {rest}
