"""Soak: a mixed trace past saturation for a set time, then checks that nothing leaked.

    python -m lab.soak --model models/small-llava --rate 2.4 --duration 600 --out soak/
    python -m lab.soak --model models/tiny-llava --rate 30 --duration 20      # the CI-sized one

Pick `--rate` as 2x the rate that saturates the configuration (`mserve bench compare` shows it).
While the load runs it samples, once a second, the resident memory of every process of the
cluster and the transfer engine's shared-memory segments in /dev/shm; the coordinator sheds what
it cannot queue (`--max-waiting-requests`) with explicit `overloaded` errors. After the load it
waits for the cluster to drain and checks: every request ended exactly once (a result with all
its tokens, or an explicit error), no request in flight, every KV block free again (used + free
== total), /dev/shm back within the transfer pools' bound. Writes soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from mserve.bench.traces import make_trace
from mserve.common.protocol.to_coordinator import WorkerLoad
from mserve.coordinator.client import AsyncClient, Client, MServeError
from mserve.coordinator.launcher import LocalCluster

SHM_GLOB = "/dev/shm/mserve_*"  # the transfer engine's segments (common/transfer/shm_pool.py)


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def shm_segments() -> int:
    return len(glob.glob(SHM_GLOB))


def sample(cluster: LocalCluster) -> dict[str, Any]:
    return {"t": time.monotonic(), "shm": shm_segments(),
            "rss_mib": {name: round(rss_mib(p.pid), 1) for name, p in cluster.processes.items()}}


def kv_state(status: dict[str, Any]) -> dict[str, dict[str, int]]:
    """used / free / total KV blocks of every worker that keeps KV (an encoder's tiny pool is skipped)."""
    out = {}
    for wid, w in status.get("workers", {}).items():
        if w.get("role") == "encode" or not w.get("alive"):
            continue
        load, counters = WorkerLoad.read(w.get("load")), w.get("counters") or {}
        out[wid] = {"used": int(counters.get("used_blocks", 0)), "free": load.free_blocks or 0,
                    "total": load.total_blocks or 0}
    return out


async def drive(address: str, trace: list, outcomes: dict[str, list[str]]) -> None:
    """Send each request at its arrival time; record every way it ended (there must be exactly one)."""
    async with AsyncClient(address, timeout_s=300, poll_interval_s=0.005) as client:
        t0 = time.monotonic()

        async def one(req) -> None:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
            try:
                res = await client.generate(req.messages, request_id=req.request_id, max_tokens=req.max_tokens,
                                            ignore_eos=True, priority=req.priority,
                                            latency_class=req.latency_class)
                ok = len(res.token_ids) == req.max_tokens
                outcomes[req.request_id].append("ok" if ok else f"short:{len(res.token_ids)}")
            except MServeError as exc:
                outcomes[req.request_id].append(exc.code)

        await asyncio.gather(*[one(r) for r in trace])


def run_soak(model: str, *, duration_s: float, rate: float, pools: dict[str, int], max_waiting: int = 32,
             max_tokens: int = 32, seed: int = 0, drain_timeout_s: float = 180.0,
             redis_url: str | None = None) -> dict[str, Any]:
    n = max(1, round(rate * duration_s))
    trace = make_trace("mixed", n, seed, rate=rate, max_tokens=max_tokens, prompt_tokens=32)
    with LocalCluster(model, redis_url=redis_url, **pools,
                      extra_coordinator_args=["--max-waiting-requests", str(max_waiting)]) as cluster:
        start = sample(cluster)
        samples = [start]
        outcomes: dict[str, list[str]] = {r.request_id: [] for r in trace}

        async def load() -> None:
            runner = asyncio.ensure_future(drive(cluster.address, trace, outcomes))
            while not runner.done():
                await asyncio.wait({runner}, timeout=1.0)
                samples.append(sample(cluster))
            await runner

        t_load = time.monotonic()
        asyncio.run(load())
        load_s = time.monotonic() - t_load
        # Drained: nothing in flight and every KV block back, or the deadline.
        deadline = time.monotonic() + drain_timeout_s
        with Client(cluster.address, timeout_s=10) as c:
            while True:
                status = c.status()
                kv = kv_state(status)
                drained = status["requests_in_flight"] == 0 and all(v["used"] == 0 for v in kv.values())
                if drained or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        end = sample(cluster)
    codes = Counter(o for outs in outcomes.values() for o in outs)
    ended_once = sum(len(o) == 1 for o in outcomes.values())
    peak = {name: max(s["rss_mib"].get(name, 0.0) for s in samples) for name in start["rss_mib"]}
    mid = min(samples, key=lambda s: abs(s["t"] - (t_load + load_s / 2)))  # growth after it = a leak's signature
    return {
        "model": model, "pools": pools, "rate": rate, "duration_s": duration_s, "load_s": round(load_s, 1),
        "max_waiting_requests": max_waiting, "max_tokens": max_tokens, "requests": len(trace),
        "outcomes": dict(codes), "ended_exactly_once": ended_once,
        "lost": sum(not o for o in outcomes.values()), "duplicated": sum(len(o) > 1 for o in outcomes.values()),
        "drained": drained, "requests_in_flight_after": status["requests_in_flight"], "kv_after": kv,
        "kv_integrity": all(v["used"] + v["free"] == v["total"] for v in kv.values()),
        "shm_segments": {"start": start["shm"], "peak": max(s["shm"] for s in samples), "end": end["shm"]},
        "rss_mib": {name: {"start": start["rss_mib"][name], "mid": mid["rss_mib"].get(name, 0.0), "peak": peak[name],
                           "end": end["rss_mib"].get(name, 0.0)} for name in start["rss_mib"]},
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Soak: {r['requests']} requests at {r['rate']} req/s for {r['duration_s']} s "
             f"({r['load_s']} s with the tail), pools {r['pools']}", "",
             f"outcomes {r['outcomes']}; ended exactly once {r['ended_exactly_once']}/{r['requests']}; "
             f"lost {r['lost']}; duplicated {r['duplicated']}",
             f"after the load: drained {r['drained']}, in flight {r['requests_in_flight_after']}, "
             f"KV integrity (used + free == total, used == 0) {r['kv_integrity']}",
             f"/dev/shm segments: start {r['shm_segments']['start']}, peak {r['shm_segments']['peak']}, "
             f"end {r['shm_segments']['end']}", "",
             "| process | RSS start MiB | mid-load | peak | end |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {v['start']} | {v['mid']} | {v['peak']} | {v['end']} |" for n, v in r["rss_mib"].items()]
    return "\n".join(lines) + "\n"


def parse_pools(spec: str) -> dict[str, int]:
    """'1e1p1d' or 'unified:2'."""
    if spec.startswith("unified:"):
        return {"unified": int(spec.split(":", 1)[1]), "encode": 0, "prefill": 0, "decode": 0}
    import re

    m = re.fullmatch(r"(\d+)e(\d+)p(\d+)d", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"pools must look like 1e1p1d or unified:2, got {spec!r}")
    return dict(zip(("encode", "prefill", "decode"), map(int, m.groups())))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.soak", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--rate", type=float, required=True, help="requests/s: 2x the configuration's saturation rate")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (default 600)")
    p.add_argument("--pools", type=parse_pools, default=parse_pools("1e1p1d"), help="1e1p1d (default) or unified:N")
    p.add_argument("--max-waiting-requests", type=int, default=32, help="the coordinator's shedding bound (32)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request, forced (32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak", help="folder for soak.json and soak.md (default ./soak)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    r = run_soak(a.model, duration_s=a.duration, rate=a.rate, pools=a.pools, max_waiting=a.max_waiting_requests,
                 max_tokens=a.max_tokens, seed=a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(r, indent=2))
    (out / "soak.md").write_text(markdown(r))
    print(markdown(r))
    healthy = (r["lost"] == 0 and r["duplicated"] == 0 and r["drained"] and r["kv_integrity"]
               and set(r["outcomes"]) <= {"ok", "overloaded"})
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
