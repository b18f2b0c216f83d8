"""Role switching with real processes: a worker switches role mid-load (decode -> prefill, then back) with
every request ending exactly once and HF-exact; and kill -9 of a worker in the middle of its switch.

One small cluster (1 encode, 1 prefill, 2 decode workers, the tiny Llava, float32), its own: the tests
change its roles and kill a worker, so it cannot be a shared one. The switches are an operator's
(`Client.switch_role`, what `mserve switch-role` sends), so they happen at a known point of the load.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from mserve.coordinator.client import AsyncClient, Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected, generate_all
from tests.coordinator.test_faults import LONG
from tests.helpers import chat, request_mix, wait_for

pytestmark = pytest.mark.slow
N = 12  # requests per batch
# Per request (ignore_eos): long enough that the switched worker still decodes when told to switch.
TOKENS = LONG
# test_faults.py's kill -9 requests (text, one and two images), for every batch here: HF's answers, most of
# these tests' time on a busy host, are computed once per session (tests/helpers.py caches them).
REQUESTS = request_mix(N, seed=3)


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    with LocalCluster(str(tiny_model_dirs["llava"]), encode=1, prefill=1, decode=2,
                      extra_coordinator_args=["--dead-after-s", "1.0"]) as cluster:
        yield cluster


def status(cluster: LocalCluster) -> dict:
    with Client(cluster.address, timeout_s=10) as client:
        return client.status()


def serving_as(cluster: LocalCluster, worker: str, role: str) -> bool:
    w = status(cluster)["workers"].get(worker, {})
    return bool(w.get("alive")) and w.get("role") == role and not w.get("switching")


async def stream_and_switch(cluster: LocalCluster, requests, pick, role: str, after_tokens: int = 2,
                            then=None) -> tuple[list, dict]:
    """Stream every request; once any has `after_tokens` tokens, switch the worker `pick(status)` names to
    `role` (and run `then(worker)`). Returns [(streamed tokens, result)] and the switch's status reply."""
    switched: dict = {}

    def switch() -> None:
        with Client(cluster.address, timeout_s=10) as client:
            worker = pick(client.status())
            switched.update(worker=worker, status=client.switch_role(worker, role))
        if then is not None:
            then(worker)

    async def one(client, text, images):
        stream = client.stream(chat(text, images), max_tokens=TOKENS, ignore_eos=True)
        seen = []
        async for tok in stream:
            seen.append(tok)
            if len(seen) >= after_tokens and not switched:
                switched["started"] = True
                await asyncio.to_thread(switch)
        return seen, stream.result

    async with AsyncClient(cluster.address, timeout_s=120) as client:
        out = await asyncio.gather(*[one(client, t, ims) for t, ims in requests])
    assert "worker" in switched
    return out, switched


def busiest(role: str):
    """The live worker of `role` holding the most stages (the coordinator's view)."""
    def pick(st: dict) -> str:
        live = {wid: w for wid, w in st["workers"].items() if w["alive"] and w["role"] == role}
        return max(sorted(live), key=lambda wid: live[wid]["load"]["inflight"])
    return pick


def check_exact_once(out, want) -> int:
    """Every request ended once with HF's tokens, and its stream had each token once; returns the re-runs."""
    assert len(out) == len(want)
    for (streamed, result), exp in zip(out, want):
        assert result is not None
        assert streamed == result.token_ids == exp
    return sum(result.attempts > 1 for _, result in out)


def test_a_worker_switches_role_mid_load_and_every_request_ends_once_hf_exact(cluster, tiny_model_dirs):
    model = str(tiny_model_dirs["llava"])
    before = status(cluster)["stats"]
    # decode -> prefill while both decode workers hold streams: the one switched drains them first.
    first = REQUESTS
    out, switched = asyncio.run(stream_and_switch(cluster, first, busiest("decode"), "prefill"))
    worker = switched["worker"]
    shown = switched["status"]["workers"][worker]
    assert shown["switching"] == "decode->prefill (draining)" and shown["load"]["inflight"] >= 1  # mid-load
    assert check_exact_once(out, expected(model, first, TOKENS, ignore_eos=True)) == 0  # drained: nothing re-run
    wait_for(lambda: serving_as(cluster, worker, "prefill"), timeout_s=60, what=f"{worker} back as prefill")
    after = status(cluster)
    assert after["roles"] == {"encode": 1, "prefill": 2, "decode": 1}
    assert after["role_switching"]["completed"] == 1 and after["role_switching"]["dropped"] == 0
    # It serves its new role: with two prefill workers a batch's prompts go to both (least backlog first).
    out = asyncio.run(generate_all(cluster.address, REQUESTS, TOKENS, ignore_eos=True))
    assert [r.token_ids for r in out] == expected(model, REQUESTS, TOKENS, ignore_eos=True)
    wait_for(lambda: status(cluster)["workers"][worker]["counters"].get("prefill_tokens", 0) > 0, timeout_s=10,
             what=f"{worker} prefilling")

    # ... and back, prefill -> decode, mid-load: the switched worker now prefills; its published KV is fetched
    # before it leaves.
    second = REQUESTS
    out, switched = asyncio.run(stream_and_switch(cluster, second, lambda st: worker, "decode", after_tokens=1))
    assert check_exact_once(out, expected(model, second, TOKENS, ignore_eos=True)) == 0
    wait_for(lambda: serving_as(cluster, worker, "decode"), timeout_s=60, what=f"{worker} back as decode")
    final = status(cluster)
    assert final["roles"] == {"encode": 1, "prefill": 1, "decode": 2} and final["role_switching"]["completed"] == 2
    assert final["stats"]["completed"] - before["completed"] == 3 * N
    assert final["stats"]["failed"] == before["failed"]
    # `mserve switch-role` refuses, naming why, a switch that would leave the pipeline no prefill worker.
    refused = subprocess.run([sys.executable, "-m", "mserve.cli", "switch-role", "prefill-0", "decode",
                              "--coordinator", cluster.address], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "the last prefill worker" in refused.stderr, refused.stderr


def test_kill_9_during_a_switch_every_request_ends_once(cluster, tiny_model_dirs):
    """The switching worker dies while it drains (its streams still running): the coordinator declares it
    dead, re-runs what it held on the other decode worker, and drops the switch."""
    model = str(tiny_model_dirs["llava"])
    requests = REQUESTS
    before = status(cluster)["stats"]
    out, switched = asyncio.run(stream_and_switch(
        cluster, requests, busiest("decode"), "prefill",
        then=lambda worker: cluster.kill_worker(worker, signal.SIGKILL)))
    worker = switched["worker"]
    assert switched["status"]["workers"][worker]["load"]["inflight"] >= 1  # it held streams when killed
    assert check_exact_once(out, expected(model, requests, TOKENS, ignore_eos=True)) >= 1  # they were re-run
    st = wait_for(lambda: (s := status(cluster))["role_switching"]["switching"] == {} and s, timeout_s=30,
                  what="the switch dropped")
    assert st["workers"][worker]["alive"] is False and st["role_switching"]["dropped"] == 1
    assert st["stats"]["completed"] - before["completed"] == N and st["stats"]["failed"] == before["failed"]
