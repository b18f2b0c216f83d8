"""What tokens that bypass the coordinator save it: its CPU per request, relayed vs direct, one run.

Usage: python -m lab.coord_tokens --model models/tiny-llava [--requests 24] [--max-tokens 64]
       [--every 16] [--json-out FILE]

Starts one real 1E1P1D cluster per setting (`LocalCluster`, private Redis) and streams the same
requests through it, `--concurrency` at a time, from a client with a token sink:

* `relayed`: the coordinator as by default (`--token-report-every 1`): every decode step's tokens
  come to it in STEP_TOKENS and it sends them on as TOKENS;
* `direct`: `--token-report-every N`: the decode worker pushes every step's tokens to the client's
  sink and reports to the coordinator every N tokens (docs/scaling.md).

The coordinator's CPU time (utime + stime of its process, from /proc) is read around the requests
alone (start-up excluded), and divided by the number of requests; the messages it took are from its
own counters. The model is tiny so that per-token coordinator work is large next to the rest; the
ratio, not the milliseconds, is what carries to GPU-class workers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model: str, every: int, requests: list[list[dict[str, Any]]], max_tokens: int,
        concurrency: int) -> dict[str, Any]:
    from mserve.coordinator.client import Client
    from mserve.coordinator.launcher import LocalCluster

    def one(messages: list[dict[str, Any]]) -> int:
        with Client(cluster.address, timeout_s=300, direct_tokens=True) as c:
            with c.stream(messages, max_tokens=max_tokens, ignore_eos=True) as s:
                return len(list(s))

    with LocalCluster(model, encode=1, prefill=1, decode=1,
                      extra_coordinator_args=["--token-report-every", str(every)]) as cluster:
        pid = cluster.processes["coordinator"].pid
        with Client(cluster.address, timeout_s=60) as c:
            before = c.status()["stats"]
        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, requests))
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
        with Client(cluster.address, timeout_s=60) as c:
            after = c.status()["stats"]
    n = len(requests)
    return {"token_report_every": every, "requests": n, "tokens": tokens, "wall_s": round(wall, 2),
            "coordinator_cpu_s": round(cpu, 3), "cpu_ms_per_request": round(cpu / n * 1e3, 2),
            "token_items_per_request": round((after["token_items"] - before["token_items"]) / n, 1),
            "completed": after["completed"] - before["completed"]}


def main(argv: list[str] | None = None) -> int:
    from mserve.bench.traces import make_trace

    p = argparse.ArgumentParser(prog="python -m lab.coord_tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--every", type=int, default=16, help="--token-report-every of the direct run")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    requests = [r.messages for r in make_trace("image", a.requests, seed=5)]
    rows = [run(a.model, every, requests, a.max_tokens, a.concurrency) for every in (1, a.every)]
    print("| setting | requests | tokens | coordinator CPU ms / request | token reports / request | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r, name in zip(rows, ("relayed (every 1)", f"direct (every {a.every})")):
        print(f"| {name} | {r['requests']} | {r['tokens']} | {r['cpu_ms_per_request']} | "
              f"{r['token_items_per_request']} | {r['wall_s']} |")
    print(f"direct / relayed coordinator CPU per request: "
          f"{rows[1]['cpu_ms_per_request'] / rows[0]['cpu_ms_per_request']:.2f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
