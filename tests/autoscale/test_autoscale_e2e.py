"""`mserve autoscale --backend local` on a real cluster: a load step grows the decode pool, removing most of
the load shrinks it again through a drain, and every request ends with all its tokens, none re-run.

Real processes throughout: Redis, a coordinator, one prefill and one decode worker (LocalCluster) on
the tiny LLaVA, the autoscaler as its own `mserve autoscale` process starting and draining `mserve
worker` processes. Text requests only: the pool under test is decode, and every process start costs
CPU this 2-core machine shares (the encode pool's parking and scale-from-zero are checked without
processes, in test_autoscale_drain.py and test_autoscale_policy.py). The test waits on conditions
(coordinator STATUS, the processes' logs), never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mserve.coordinator.client import AsyncClient
from mserve.coordinator.launcher import LocalCluster
from tests.helpers import chat

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hi", "Write a haiku about the sea.", "Count to ten.", "Tell me a story about a small robot."]
# Decode load = sequences per replica. Seven request streams (> 5.5 on one replica) grow the pool to two;
# four (4 on one replica would be < 4.5) shrink it back. Each stream keeps one request in flight, so the
# drained worker holds about two of the four when its SIGTERM comes.
STEP_STREAMS, LOW_STREAMS = 7, 4
UP_AT, DOWN_AT = 5.5, 4.5
# Long requests: little admission / prefill churn, so the CPU left for the new worker's start-up goes
# further; and they outlast the drain, so the drained worker is mid-request when it starts.
TOKENS_STEP, TOKENS_LOW = 128, 192


@pytest.fixture
def model(request) -> str:
    built = ROOT / "models" / "tiny-llava"
    if (built / "config.json").is_file():
        return str(built)
    return str(request.getfixturevalue("tiny_model_dirs")["llava"])


def autoscale_command(cluster: LocalCluster, model: str, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "mserve.cli", "autoscale", "--backend", "local", "--model", model,
            "--coordinator", cluster.address, "--worker-address", cluster.worker_address, "--redis", cluster.redis_url,
            "--log-dir", str(log_dir), "--interval", "0.3",
            "--min", "1", "--min", "encode=0", "--max", "encode=1", "--max", "prefill=1", "--max", "decode=2",
            "--scale-up-at", f"decode={UP_AT}", "--scale-down-at", f"decode={DOWN_AT}",
            "--up-cooldown", "0", "--down-cooldown", "1", "--down-stable", "1.5"]


class Load:
    """Request streams: each keeps one request in flight, and records every outcome."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.outcomes: list[tuple[str, int, object]] = []  # (prompt key, max_tokens, GenerateResult or exception)
        self.tasks: list[tuple[asyncio.Task, asyncio.Event]] = []
        self._n = 0

    def start(self, n: int, max_tokens: int) -> None:
        for _ in range(n):
            stop = asyncio.Event()
            self.tasks.append((asyncio.create_task(self._stream(self._n, max_tokens, stop)), stop))
            self._n += 1

    async def _stream(self, k: int, max_tokens: int, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            prompt = PROMPTS[(k + i) % len(PROMPTS)]
            i += 1
            try:
                r = await self.client.generate(chat(prompt), max_tokens=max_tokens, ignore_eos=True, timeout_s=120)
            except Exception as exc:  # recorded: the test fails on any
                r = exc
            self.outcomes.append((prompt, max_tokens, r))

    async def stop(self, first: int | None = None) -> None:
        """Stop the `first` streams started (all by default); each finishes its request in flight."""
        first = len(self.tasks) if first is None else first
        stopping, self.tasks = self.tasks[:first], self.tasks[first:]
        for _, ev in stopping:
            ev.set()
        await asyncio.gather(*(t for t, _ in stopping))


async def wait_until(cond, what: str, timeout_s: float, check=None):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


def decode_pool(status: dict) -> tuple[list[str], list[str]]:
    """(serving decode workers, draining ones), alive only."""
    live = {w: i for w, i in status["workers"].items() if i["role"] == "decode" and i["alive"]}
    draining = sorted(w for w, i in live.items() if i.get("draining"))
    return sorted(w for w in live if w not in draining), draining


async def scenario(cluster: LocalCluster, scaler: subprocess.Popen, scaler_log: Path) -> dict:
    def alive():
        assert scaler.poll() is None, f"autoscaler exited ({scaler.returncode}):\n{scaler_log.read_text()[-3000:]}"

    async with AsyncClient(cluster.address, timeout_s=120) as client:
        load = Load(client)
        t0 = time.monotonic()
        load.start(STEP_STREAMS, TOKENS_STEP)

        async def grown():
            status = await client.status()
            ready, _ = decode_pool(status)
            new = [w for w in ready if w not in cluster.worker_names("decode")]
            # Serving: it has decoded tokens for some of the requests.
            return new[0] if new and status["workers"][new[0]]["counters"].get("decode_tokens", 0) > 0 else None

        new = await wait_until(grown, "the decode pool to grow and the new worker to serve", 120, alive)
        t_grown = time.monotonic()
        # The low streams start before the step streams stop (finishing their requests in flight): the
        # pool never runs empty, so whichever worker is drained has requests on it.
        load.start(LOW_STREAMS, TOKENS_LOW)
        await load.stop(first=STEP_STREAMS)

        async def shrunk():
            ready, draining = decode_pool(await client.status())
            return new not in ready and new not in draining and len(ready) == 1

        await wait_until(shrunk, "the decode pool to shrink back to one", 60, alive)
        t_shrunk = time.monotonic()

        async def reaped():  # the autoscaler saw its worker exit
            return re.search(re.escape(new) + r" drained and exited \(code 0\)", scaler_log.read_text())

        await wait_until(reaped, "the autoscaler to see the drained worker exit", 15, alive)
        await load.stop()
        return {"new": new, "outcomes": load.outcomes, "grow_s": t_grown - t0, "shrink_s": t_shrunk - t_grown}


def test_load_step_grows_decode_and_its_removal_drains_it_back_without_losing_a_request(model, redis_url, tmp_path):
    t_start = time.monotonic()
    worker_logs = tmp_path / "autoscaled"
    scaler_log = tmp_path / "autoscale.log"
    with LocalCluster(model, encode=0, prefill=1, decode=1, redis_url=redis_url,
                      log_dir=str(tmp_path / "cluster")) as cluster:
        t_ready = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        with open(scaler_log, "wb") as out:
            scaler = subprocess.Popen(autoscale_command(cluster, model, worker_logs), stdout=out,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            result = asyncio.run(scenario(cluster, scaler, scaler_log))
        finally:
            scaler.send_signal(signal.SIGTERM)  # drains whatever it still runs, then exits
            try:
                scaler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(scaler.pid, signal.SIGKILL)
                scaler.wait()
        t_stop = time.monotonic()
    log = scaler_log.read_text()
    new = result["new"]

    # Every request ended with all its tokens, on its first attempt: the scale-down lost and re-ran nothing.
    outcomes = result["outcomes"]
    errors = [r for _, _, r in outcomes if isinstance(r, Exception)]
    assert not errors, errors[:3]
    for key, max_tokens, r in outcomes:
        assert (len(r.token_ids), r.finish_reason, r.attempts) == (max_tokens, "length", 1), (key, r)
    same: dict[tuple[str, int], list[int]] = {}
    for key, max_tokens, r in outcomes:  # greedy: one prompt, one answer, whichever decode worker ran it
        assert same.setdefault((key, max_tokens), r.token_ids) == r.token_ids, key
    assert len(outcomes) >= STEP_STREAMS + LOW_STREAMS

    # The autoscaler said what it did and why, and the worker drained rather than died.
    grew = r"decode: 1 -> 2 \(up\): load \d+ sequences = [\d.]+ per replica > 5\.5 \| started "
    assert re.search(grew + new, log), log
    assert re.search(r"decode: 2 -> 1 \(down\): .* \| draining " + new + r" \(pid \d+, SIGTERM\)", log), log
    assert re.search(new + r" drained and exited \(code 0\)", log), log
    worker_log = (worker_logs / f"{new}.log").read_text()
    started = re.search(r"draining \(SIGTERM\): (\d+) running, (\d+) queued", worker_log)
    assert started, worker_log[-2000:]
    assert int(started.group(1)) + int(started.group(2)) >= 1, "the drained worker had no request in flight"
    assert f"{new} exits: drained: released by the coordinator" in worker_log
    coordinator_log = (tmp_path / "cluster" / "coordinator.log").read_text()
    assert f"worker {new} drained: no work of this coordinator left on it; SHUTDOWN sent" in coordinator_log
    assert scaler.returncode == 0
    print(f"\ncluster up {t_ready - t_start:.1f}s, grew in {result['grow_s']:.1f}s, "
          f"shrank in {result['shrink_s']:.1f}s,"
          f" {len(outcomes)} requests, stop {t_stop - t_ready:.1f}s after ready")
