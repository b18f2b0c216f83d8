"""Sharded coordinators' CPU (docs/scaling.md): K real coordinator shards, side by side with one.

Usage: python -m lab.coord_shards --model models/small-llava [--shards 2] [--scale 1] [--json-out FILE]
   or: python -m lab.coord_calibrate --model models/small-llava --shards 2 [--json-out FILE]

For K = 1 and K = --shards, in one invocation and on one private Redis: K `mserve coordinator
--shard-id shard-i --redis URL` processes, the fake workers and client of coord_calibrate.FakeCluster
(each fake worker holds one DEALER per shard under one identity, sends READY and heartbeats to every
shard, answers each stage message on the socket it came in on and splits a decode step's tokens into
one STEP_TOKENS per shard; the client holds one DEALER per shard and sends each request to
``pick_shard(request id, client addresses)``). No model work is done: the coordinators are what is
paid for. Per K:

* idle, with 3 and with 48 workers: each shard's CPU per second, and per worker per second (the
  heartbeats every 0.25 s and Redis load reads that every shard pays for every worker);
* closed loop, 8 requests in flight, streaming, 33 output tokens: image requests, then text requests.
  Reported: requests/s; coordinator CPU per request summed over the shards (raw, and net of each
  shard's idle CPU over the run); each shard's CPU per request it owned, share of the requests and
  busy fraction; the driver's own CPU per request (this process: client, fake workers, heartbeats)
  and busy fraction; Redis's CPU per request; the host's busy fraction (/proc/stat); messages and
  STEP_TOKENS per request (a decode step sends one STEP_TOKENS per shard present in its batch, so
  with K shards each carries fewer items). A driver near one full core, or a host near all its
  cores, bounded the throughput, not the coordinators.

CPU times are utime + stime from /proc (10 ms ticks; threads included). On a host with few cores the
K coordinators, the driver and Redis share them, so aggregate requests/s cannot grow with K there;
what carries over is the split of coordinator CPU per request and the per-shard cost of workers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.coord_calibrate import FakeCluster, _bodies, _cpu_s

IDLE_WORKERS = (3, 48)
WORKLOADS = (("image", 1600, 33), ("text", 1600, 33))  # modality, requests at scale 1, output tokens
CONCURRENCY = 8
# Distinct request bodies built per workload (an image takes ~25 ms to make); the run cycles through
# them under fresh request ids. Nothing caches by image or prompt here (fake workers publish no
# embeddings or prefix blocks), so a repeated body costs the coordinator what a new one would.
DISTINCT_BODIES = 400


def _host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host since boot, from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - v[3] - v[4], total


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Shards:
    """K coordinator processes, shard-0 .. shard-{K-1}, announced in one Redis."""

    def __init__(self, model: str, k: int, redis_url: str) -> None:
        from mserve.common.redis_server import free_port

        self.model = model
        self.ids = [f"shard-{i}" for i in range(k)]
        self.client_addrs, self.worker_addrs, self.procs = [], [], []
        for sid in self.ids:
            cport, wport = free_port(), free_port()
            self.client_addrs.append(f"tcp://127.0.0.1:{cport}")
            self.worker_addrs.append(f"tcp://127.0.0.1:{wport}")
            cmd = [sys.executable, "-m", "mserve.cli", "coordinator", "--model", model, "--bind",
                   self.client_addrs[-1], "--worker-bind", self.worker_addrs[-1], "--redis", redis_url,
                   "--shard-id", sid]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def cpu(self) -> list[float]:
        return [_cpu_s(pid) for pid in self.pids]

    def check(self) -> None:
        for sid, p in zip(self.ids, self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"coordinator {sid} exited with {p.returncode}")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cycled(pool: list[dict[str, Any]], n: int, prefix: str) -> list[dict[str, Any]]:
    """`n` request bodies cycling through `pool`, with request ids prefix0 .. prefix{n-1}."""
    return [{**pool[i % len(pool)], "request_id": f"{prefix}{i}"} for i in range(n)]


def _warm(fake: FakeCluster, shards: Shards, pool: list[dict[str, Any]], per_shard: int = 3,
          timeout_s: float = 120) -> None:
    """Wait until every shard serves (answers requests that hash to it), which also warms it."""
    from mserve.common.shards import pick_shard

    chosen: dict[str, list[dict[str, Any]]] = {a: [] for a in shards.client_addrs}
    for b in cycled(pool, 1000 * len(shards.ids), "warm"):
        mine = chosen[pick_shard(b["request_id"], shards.client_addrs)]
        if len(mine) < per_shard:
            mine.append(b)
    bodies = [b for group in chosen.values() for b in group]
    deadline, before = time.monotonic() + timeout_s, fake.results
    for b in bodies:
        fake.submit(b)
    while fake.results - before < len(bodies):
        fake.turn(50)
        shards.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"coordinator shards did not come up within {timeout_s:.0f} s")


class _Meter:
    """CPU of the shards, this process, Redis and the host, and wall time, between start() and stop()."""

    def __init__(self, shards: Shards, redis_pid: int | None) -> None:
        self.shards, self.redis_pid = shards, redis_pid

    def _read(self) -> tuple[list[float], float, float, tuple[int, int], float]:
        redis = _cpu_s(self.redis_pid) if self.redis_pid else 0.0
        return self.shards.cpu(), time.process_time(), redis, _host_jiffies(), time.perf_counter()

    def start(self) -> _Meter:
        self._t0 = self._read()
        return self

    def stop(self) -> dict[str, Any]:
        (s0, d0, r0, h0, t0), (s1, d1, r1, h1, t1) = self._t0, self._read()
        return {"wall_s": t1 - t0, "shard_cpu_s": [b - a for a, b in zip(s0, s1)], "driver_cpu_s": d1 - d0,
                "redis_cpu_s": r1 - r0, "host_busy": (h1[0] - h0[0]) / max(1, h1[1] - h0[1])}


def idle(fake: FakeCluster, meter: _Meter, seconds: float) -> dict[str, Any]:
    meter.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fake.turn(20)
    return {"workers": len(fake.workers), **meter.stop()}


def closed_loop(fake: FakeCluster, meter: _Meter, bodies: list[dict[str, Any]], concurrency: int,
                timeout_s: float = 300) -> dict[str, Any]:
    """Keep `concurrency` requests in flight until every one has its RESULT."""
    by_shard0, msgs0 = [dict(s) for s in fake.by_shard], dict(fake.msgs)
    results0, sent = fake.results, 0
    meter.start()
    t0 = time.perf_counter()
    while fake.results - results0 < len(bodies):
        while sent < len(bodies) and sent - (fake.results - results0) < concurrency:
            fake.submit(bodies[sent])
            sent += 1
        fake.turn(5)
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"closed-loop run took over {timeout_s:.0f} s")
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # the last replies' aftermath
    m = meter.stop()
    m["wall_s"] = wall
    by_shard = [{k: s1[k] - s0[k] for k in s1} for s0, s1 in zip(by_shard0, fake.by_shard)]
    msgs = {k: fake.msgs[k] - msgs0[k] for k in msgs0}  # to/from the coordinators, STEP_TOKENS, token items
    return {"requests": len(bodies), "results": fake.results - results0, "by_shard": by_shard, "messages": msgs, **m}


def _measure(fake: FakeCluster, shards: Shards, redis_pid: int | None, counts: dict[str, int],
             pools: dict[str, list[dict[str, Any]]], idle_s: float,
             t0: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Warm the shards, then: idle with 3 workers, the closed-loop runs, idle with 48 workers."""
    meter = _Meter(shards, redis_pid)
    for wid, role in (("encode-0", "encode"), ("prefill-0", "prefill"), ("decode-0", "decode")):
        fake.add_worker(wid, role)
    _warm(fake, shards, pools["warm"])
    startup_s = time.perf_counter() - t0
    idles = [idle(fake, meter, idle_s)]
    runs = []
    for modality, _, tokens in WORKLOADS:
        bodies = cycled(pools[modality], counts[modality], f"{modality[0]}{len(shards.ids)}-")
        load0 = _loadavg()
        r = closed_loop(fake, meter, bodies, CONCURRENCY)
        runs.append({"modality": modality, "max_tokens": tokens, "concurrency": CONCURRENCY,
                     "loadavg_before": load0, "loadavg_after": _loadavg(), **r})
        shards.check()
    for i in range(IDLE_WORKERS[1] - IDLE_WORKERS[0]):
        fake.add_worker(f"decode-x{i}", "decode")
    time.sleep(0.5)
    idles.append(idle(fake, meter, idle_s))
    return runs, idles, startup_s


def measure_config(model: str, k: int, redis_url: str, redis_pid: int | None, counts: dict[str, int],
                   pools: dict[str, list[dict[str, Any]]], idle_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    shards = Shards(model, k, redis_url)
    try:
        fake = FakeCluster(shards.client_addrs, shards.worker_addrs, redis_url, shards.model)
        try:
            runs, idles, startup_s = _measure(fake, shards, redis_pid, counts, pools, idle_s, t0)
        finally:
            fake.close()
    finally:
        shards.stop()
    return {**summarize(k, shards, runs, idles), "startup_s": startup_s}


def summarize(k: int, shards: Shards, runs: list[dict[str, Any]], idles: list[dict[str, Any]]) -> dict[str, Any]:
    lo, hi = idles
    idle_by_shard = []
    for i, sid in enumerate(shards.ids):
        rate_lo, rate_hi = lo["shard_cpu_s"][i] / lo["wall_s"], hi["shard_cpu_s"][i] / hi["wall_s"]
        per_worker = (rate_hi - rate_lo) / (hi["workers"] - lo["workers"])
        idle_by_shard.append({"shard": sid, "cpu_s_per_s": {str(lo["workers"]): rate_lo, str(hi["workers"]): rate_hi},
                              "per_worker_per_s": per_worker})
    for r in runs:
        n, wall = r["requests"], r["wall_s"]
        idle_cpu = [s["cpu_s_per_s"][str(lo["workers"])] * wall for s in idle_by_shard]
        r["requests_per_s"] = n / wall
        r["coordinator_cpu_per_request_s"] = sum(r["shard_cpu_s"]) / n
        r["coordinator_cpu_per_request_net_of_idle_s"] = (sum(r["shard_cpu_s"]) - sum(idle_cpu)) / n
        r["driver_cpu_per_request_s"] = r["driver_cpu_s"] / n
        r["driver_busy"] = r["driver_cpu_s"] / wall
        r["redis_cpu_per_request_s"] = r["redis_cpu_s"] / n
        r["shards"] = [{"shard": sid, "requests": b["requests"], "results": b["results"], "messages": b["messages"],
                        "share": b["requests"] / n, "cpu_s": cpu, "busy": cpu / wall,
                        "cpu_per_own_request_s": cpu / b["requests"] if b["requests"] else None,
                        "cpu_per_own_request_net_of_idle_s":
                            (cpu - ic) / b["requests"] if b["requests"] else None}
                       for sid, b, cpu, ic in zip(shards.ids, r.pop("by_shard"), r["shard_cpu_s"], idle_cpu)]
    return {"shards": k, "shard_ids": shards.ids, "runs": runs, "idle": idles, "idle_by_shard": idle_by_shard}


def measure_shards(model: str, shards: int = 2, scale: float = 1.0, idle_s: float = 4.0,
                   redis_url: str | None = None) -> dict[str, Any]:
    """K = 1 and K = `shards`, one after the other on one Redis (a private one unless `redis_url`)."""
    from contextlib import nullcontext

    from mserve.common.redis_server import RedisServer

    counts = {modality: max(CONCURRENCY, int(n * scale)) for modality, n, _ in WORKLOADS}
    pools = {modality: _bodies(model, modality, min(counts[modality], DISTINCT_BODIES), tokens)
             for modality, _, tokens in WORKLOADS}
    pools["warm"] = _bodies(model, "image", 8, 2)
    configs = []
    with (nullcontext() if redis_url else RedisServer()) as redis:
        url = redis_url or redis.url
        proc = getattr(redis, "_proc", None)
        for k in sorted({1, shards}):
            configs.append(measure_config(model, k, url, proc.pid if proc else None, counts, pools, idle_s))
    return {"model": model, "cores": os.cpu_count(), "concurrency": CONCURRENCY, "counts": counts,
            "distinct_bodies": {m: len(pools[m]) for m, _, _ in WORKLOADS},
            "heartbeat_s": 0.25, "configs": configs,
            "note": "fake workers (no model), real coordinator processes + Redis; CPU from /proc (10 ms ticks); "
                    "net_of_idle subtracts each shard's idle CPU/s with 3 workers times the run's wall time"}


def table(out: dict[str, Any]) -> str:
    ms = 1e3
    lines = [f"{out['model']}: closed loop, {out['concurrency']} in flight, streaming, host with {out['cores']} cores",
             "", f"{'run':<10}{'K':>3}{'req':>6}{'req/s':>8}{'coord CPU/req ms':>18}{'net of idle':>13}"
                 f"{'driver CPU/req':>16}{'driver busy':>13}{'redis/req':>11}{'host busy':>11}{'msgs/req':>10}"
                 f"{'steps/req':>11}{'loadavg':>12}"]
    for c in out["configs"]:
        for r in c["runs"]:
            lines.append(f"{r['modality'] + '/' + str(r['max_tokens']):<10}{c['shards']:>3}{r['requests']:>6}"
                         f"{r['requests_per_s']:>8.1f}{r['coordinator_cpu_per_request_s'] * ms:>18.2f}"
                         f"{r['coordinator_cpu_per_request_net_of_idle_s'] * ms:>13.2f}"
                         f"{r['driver_cpu_per_request_s'] * ms:>16.2f}{r['driver_busy']:>13.0%}"
                         f"{r['redis_cpu_per_request_s'] * ms:>11.2f}{r['host_busy']:>11.0%}"
                         f"{(r['messages']['to_coordinator'] + r['messages']['from_coordinator']) / r['requests']:>10.1f}"
                         f"{r['messages']['step_msgs'] / r['requests']:>11.2f}"
                         f"{r['loadavg_before']:>6.2f}>{r['loadavg_after']:<5.2f}")
    lines += ["", "per shard (CPU per request = the shard's CPU over the run / the requests it owned):",
              f"{'run':<10}{'K':>3}  {'shard':<9}{'share':>7}{'results':>9}{'CPU/req ms':>12}{'net of idle':>13}"
              f"{'busy':>7}"]
    for c in out["configs"]:
        for r in c["runs"]:
            for s in r["shards"]:
                per = s["cpu_per_own_request_s"]
                net = s["cpu_per_own_request_net_of_idle_s"]
                lines.append(f"{r['modality'] + '/' + str(r['max_tokens']):<10}{c['shards']:>3}  {s['shard']:<9}"
                             f"{s['share']:>7.0%}{s['results']:>9}{'-' if per is None else f'{per * ms:.2f}':>12}"
                             f"{'-' if net is None else f'{net * ms:.2f}':>13}{s['busy']:>7.0%}")
    lines += ["", "idle (heartbeats every 0.25 s + Redis load reads + ticks), per shard:",
              f"{'K':>3}  {'shard':<9}{'ms/s, 3 workers':>17}{'ms/s, 48':>10}{'per worker ms/s':>17}"]
    for c in out["configs"]:
        for s in c["idle_by_shard"]:
            rates = list(s["cpu_s_per_s"].values())
            lines.append(f"{c['shards']:>3}  {s['shard']:<9}{rates[0] * ms:>17.2f}{rates[1] * ms:>10.2f}"
                         f"{s['per_worker_per_s'] * ms:>17.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shards", type=int, default=2, help="K, measured side by side with 1 (default 2)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the request counts (1600 each at 1)")
    p.add_argument("--idle-s", type=float, default=4.0, help="length of each idle window")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.shards < 1:
        p.error("--shards must be at least 1")
    out = measure_shards(args.model, args.shards, args.scale, args.idle_s)
    print(table(out))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nJSON: {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
