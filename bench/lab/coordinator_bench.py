"""Coordinator overhead: latency a request gains by going through the coordinator, at a given request rate.

A real local cluster (one unified worker on a tiny checkpoint) serves trivial requests (short
text, one output token). For each request, overhead = client-observed latency minus the time the
worker reports having held it (`timings.worker_s`, its queueing included): what remains is the
coordinator's admission, routing and bookkeeping plus the two extra ZeroMQ hops it adds.

Usage: python -m lab.coordinator_bench --model DIR [--rates 20,200] [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


async def _drive(address: str, rate: float, n: int) -> list[dict]:
    from mserve.coordinator.client import AsyncClient

    records: list[dict] = []
    messages = [{"role": "user", "content": "Hi"}]
    async with AsyncClient(address, timeout_s=60) as client:
        await client.generate(messages, max_tokens=1)  # warm-up

        async def one(i: int) -> None:
            t0 = time.perf_counter()
            r = await client.generate(messages, max_tokens=1)
            e2e = time.perf_counter() - t0
            records.append({"e2e_s": e2e, "worker_s": r.timings["worker_s"], "coordinator_total_s": r.timings["total_s"]})

        start = time.perf_counter()
        tasks = []
        for i in range(n):
            # Fixed spacing: the rate is the offered load, not a burst pattern.
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        achieved = n / (time.perf_counter() - start)
    for r in records:
        r["achieved_rate"] = achieved
    return records


def _pcts(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a tiny checkpoint (mserve make-tiny-model)")
    p.add_argument("--rates", default="20,200", help="offered request rates, req/s (default 20,200)")
    p.add_argument("--requests", type=int, default=1000, help="requests per rate (default 1000)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from mserve.common.perf import tune_malloc
    from mserve.coordinator.launcher import LocalCluster

    tune_malloc()
    out = {}
    with LocalCluster(args.model, encode=0, prefill=0, decode=0, unified=1) as cluster:
        for rate in [float(r) for r in args.rates.split(",")]:
            recs = asyncio.run(_drive(cluster.address, rate, args.requests))
            out[rate] = {"achieved_rate": recs[0]["achieved_rate"],
                         "overhead": _pcts([r["e2e_s"] - r["worker_s"] for r in recs]),
                         "e2e": _pcts([r["e2e_s"] for r in recs]),
                         "worker": _pcts([r["worker_s"] for r in recs])}
    print("| offered req/s | achieved req/s | overhead p50 / p90 / p99 (ms) | client e2e p50 / p99 (ms) | "
          "worker p50 / p99 (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for rate, r in out.items():
        o, e, w = r["overhead"], r["e2e"], r["worker"]
        print(f"| {rate:.0f} | {r['achieved_rate']:.1f} | {o['p50_ms']:.2f} / {o['p90_ms']:.2f} / {o['p99_ms']:.2f} | "
              f"{e['p50_ms']:.2f} / {e['p99_ms']:.2f} | {w['p50_ms']:.2f} / {w['p99_ms']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
