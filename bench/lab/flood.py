"""Class-flood trace: `batch` requests far past saturation plus a trickle of `interactive` ones.

    python -m lab.flood --out flood.jsonl [--trace image] [--batch-rate 3] [--interactive-rate 0.2]
                                 [--duration 120] [--seed 0]

Writes a replayable trace (one JSON object a line) for `mserve bench serve|compare --trace-file`.
Every request has priority 0, so the latency class alone tells them apart; ids start with "b" or
"i". What a serving system should show on it: interactive requests inside their SLO, every batch
request either served or refused with an explicit `overloaded` error, none lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from mserve.bench.traces import TRACE_NAMES, make_trace, save_trace


def flood_trace(trace: str, batch_rate: float, interactive_rate: float, duration_s: float, seed: int,
                max_tokens: int = 64, prompt_tokens: int = 64) -> list:
    out = []
    for prefix, rate, cls, sub_seed in (("b", batch_rate, "batch", seed), ("i", interactive_rate, "interactive",
                                                                            seed + 1)):
        n = max(1, math.floor(rate * duration_s))
        for req in make_trace(trace, n, sub_seed, rate=rate, max_tokens=max_tokens, prompt_tokens=prompt_tokens):
            out.append(dataclasses.replace(req, request_id=prefix + req.request_id, priority=0, latency_class=cls))
    return sorted(out, key=lambda r: (r.arrival_s, r.request_id))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.flood", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    p.add_argument("--trace", default="image", choices=[t for t in TRACE_NAMES if t != "multiturn"],
                   help="request shape of both classes (default image)")
    p.add_argument("--batch-rate", type=float, default=3.0, help="batch requests/s (default 3)")
    p.add_argument("--interactive-rate", type=float, default=0.2, help="interactive requests/s (default 0.2)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (default 120)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    trace = flood_trace(a.trace, a.batch_rate, a.interactive_rate, a.duration, a.seed, a.max_tokens)
    path = save_trace(trace, a.out)
    n_int = sum(r.latency_class == "interactive" for r in trace)
    print(f"wrote {len(trace)} requests ({len(trace) - n_int} batch, {n_int} interactive) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
