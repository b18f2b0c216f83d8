"""Is the load generator ever the bottleneck? Its dispatch lag at a high rate against a real tiny cluster.

Starts one unified worker on a tiny checkpoint (LocalCluster), then drives `--requests` requests of the
`text` trace at `--rate` (Poisson) through exactly the code `mserve bench serve` uses (mserve.bench.serve.drive
with the ZeroMQ target), and reports the dispatch lag (actual send time - scheduled time), the achieved
send rate and what the cluster completed. The same schedule is also driven against a null target
(nothing sent) to separate the generator's own cost from CPU contention with the cluster on this host.

Usage: python -m lab.loadgen_check [--model DIR] [--rate 500] [--requests 2500] [--max-tokens 1]
(without --model a tiny llava checkpoint is built in a temp folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from typing import Any


class NullTarget:
    """Accepts every request instantly: what the schedule costs with no server and no replies."""

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def prepare(self, req: Any) -> None:
        return None

    async def run(self, req: Any, prepared: Any, rec: Any) -> None:
        rec.start_s = rec.first_token_s = rec.end_s = time.perf_counter()
        rec.token_times_s.append(rec.start_s)
        rec.output_tokens = 1


def _row(name: str, lg: dict[str, Any], records: list[Any]) -> str:
    lag = lg["dispatch_lag_ms"]
    ok = sum(r.ok for r in records)
    ends = [r.end_s for r in records if r.ok]
    starts = [r.start_s for r in records]
    served = ok / (max(ends) - min(starts)) if ends and max(ends) > min(starts) else float("nan")
    return (f"| {name} | {lg['offered_rate']:.0f} | {lg['achieved_send_rate']:.0f} | {lag['p50']:.2f} | "
            f"{lag['p99']:.2f} | {lag['max']:.2f} | {lg['late_over_10ms']} | {ok}/{len(records)} | {served:.0f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.loadgen_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="tiny checkpoint folder (default: build one in a temp dir)")
    p.add_argument("--rate", type=float, default=500.0, help="offered requests/s (default 500)")
    p.add_argument("--requests", type=int, default=2500, help="requests (default 2500: 5 s at 500 req/s)")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (default 1)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="words per prompt (default 16)")
    p.add_argument("--trace", default="text", help="trace name (default text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def _terminate(*_: Any) -> None:
        raise SystemExit(143)  # unwinds through LocalCluster's `with`, which stops the cluster

    signal.signal(signal.SIGTERM, _terminate)

    from mserve.bench.serve import drive, run_trace
    from mserve.bench.zmq_target import ZmqTarget
    from mserve.bench.traces import make_trace
    from mserve.common.perf import tune_malloc
    from mserve.coordinator.launcher import LocalCluster

    tune_malloc()
    trace = make_trace(args.trace, args.requests, args.seed, rate=args.rate, max_tokens=args.max_tokens,
                       prompt_tokens=args.prompt_tokens, resolutions=[((224, 224), 1.0)])
    results: dict[str, Any] = {}
    null_records, results["null"] = asyncio.run(drive(NullTarget(), trace))
    with tempfile.TemporaryDirectory(prefix="mserve-loadgen-") as tmp:
        model = args.model
        if model is None:
            from mserve.common.tiny_model import make_tiny_model

            model = str(make_tiny_model(f"{tmp}/tiny-llava", "llava", "tiny", seed=0))
        with LocalCluster(model, encode=0, prefill=0, decode=0, unified=1) as cluster:
            target = ZmqTarget(cluster.address, ignore_eos=True, timeout_s=600.0)
            zmq_records, results["zmq"] = asyncio.run(run_trace(target, trace, warmup=2, max_tokens=args.max_tokens,
                                                                progress_label="loadgen"))
    print(f"{args.requests} `{args.trace}` requests, Poisson at {args.rate:g} req/s, max_tokens {args.max_tokens}, "
          f"one unified tiny worker; lag = actual send - scheduled send")
    print("| target | offered req/s | achieved send req/s | lag p50 ms | lag p99 ms | lag max ms | sends >10 ms late "
          "| completed | served req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(_row("null (no server)", results["null"], null_records))
    print(_row("zmq, unified tiny cluster", results["zmq"], zmq_records))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    # Kept up: every request sent at >= 97 % of the offered rate, half of them within 2 ms of schedule.
    zmq = results["zmq"]
    kept_up = (zmq["achieved_send_rate"] or 0) >= 0.97 * args.rate and zmq["dispatch_lag_ms"]["p50"] < 2.0
    return 0 if kept_up and all(r.ok for r in zmq_records) else 1


if __name__ == "__main__":
    sys.exit(main())
