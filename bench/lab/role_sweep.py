"""`python -m lab.role_sweep`: the role policy's thresholds (coordinator/role_policy.py) against the scale model.

    python -m lab.role_sweep [--grid wide|narrow] [--num-requests 240 --max-concurrency 32 --seeds 1,2] [--json-out F]

Two regimes: the measured CPU cost file `cpu-small-llava` (decode is the slower stage) and that file
"scaled" to about the bf16 engine of 2026-12-07 (decode x0.13, prefill x0.45, encode x0.5: prefill is the
slower stage; bench/lab/NOTEBOOK.md, "Adaptive lending, in the scale model"). Three traces: `image`, `mixed`,
and `shift` (a prefill-heavy half, image prompts with short replies, then a decode-heavy half, text
prompts with long replies, sent in that order). Beside the fixed layouts 1e1p1d, 1e2p1d and 1e1p2d it
runs role switching (the coordinator's own `decide`, bench/lab/sim/roles.py) from 1e2p1d and from
1e1p2d, with `RolePolicy`'s defaults, the hand-set ones they replaced, and each candidate of a grid, and
prints req/s and TTFT p99, and the candidates ranked against the best fixed layout of each case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from typing import Any, Iterator

from lab.sim.costs import Costs
from lab.sim.workload import SimRequest, from_costs
from lab.simulate import simulate
from mserve.coordinator.role_policy import RolePolicy

SCALED = {"decode": 0.13, "prefill": 0.45, "encode": 0.5}
FIXED = {"1p1d": (1, 1), "2p1d": (2, 1), "1p2d": (1, 2)}
SWITCH_FROM = {"2p1d": (2, 1), "1p2d": (1, 2)}
BEFORE = dataclasses.replace(RolePolicy(), decode_light_seqs=4)  # the hand-set default, before this sweep


def scaled(costs: Costs, factors: dict[str, float] = SCALED) -> Costs:
    """The cost file with every stage's seconds multiplied by its factor (the measured tables left as they are)."""
    data = dict(costs.data, name=f"{costs.name}-scaled")
    for stage, f in factors.items():
        data[stage] = {k: v * f if k.endswith("_s") and isinstance(v, (int, float)) else v
                       for k, v in costs.data[stage].items()}
    return Costs(data)


def shift_trace(costs: Costs, num_requests: int, seed: int, *, short: int = 16, long: int = 256) -> list[SimRequest]:
    """Prefill-heavy then decode-heavy: image prompts with `short`-token replies, then text prompts with
    `long`-token replies, all queued at once (a closed loop sends them in that order)."""
    first = from_costs(costs, "image", num_requests // 2, seed, max_tokens=short)
    second = from_costs(costs, "text", num_requests - len(first), seed, max_tokens=long)
    for r in second:
        r.rid += len(first)
    return first + second


def requests(costs: Costs, trace: str, num_requests: int, seed: int, max_tokens: int) -> list[SimRequest]:
    if trace == "shift":
        return shift_trace(costs, num_requests, seed)
    return from_costs(costs, trace, num_requests, seed, max_tokens=max_tokens)


# The grids: how heavy a regime must be (the light edge an eighth of the heavy one, as today), and how
# long it must hold / how long after a switch the next may start. `wide` first; `narrow` around its best.
GRIDS = {
    "wide": {"prefill_heavy": (1024, 2048, 4096), "decode_heavy": (8, 16, 32), "hold": ((2.0, 10.0), (5.0, 30.0))},
    "narrow": {"prefill_heavy": (1024, 2048), "decode_heavy": (24, 32, 48),
               "hold": ((2.0, 30.0), (5.0, 30.0), (5.0, 60.0))},
}


def candidates(grid: str) -> Iterator[RolePolicy]:
    g = GRIDS[grid]
    for prefill_heavy in g["prefill_heavy"]:
        for decode_heavy in g["decode_heavy"]:
            for sustain, cooldown in g["hold"]:
                yield RolePolicy(prefill_heavy, prefill_heavy // 8, decode_heavy, max(1, decode_heavy // 8),
                                 sustain, cooldown)


def label(p: RolePolicy) -> str:
    return (f"P{p.prefill_heavy_tokens}/{p.prefill_light_tokens} D{p.decode_heavy_seqs}/{p.decode_light_seqs} "
            f"s{p.sustain_s:g} c{p.cooldown_s:g}")


def run_one(costs: Costs, reqs: list[SimRequest], pools: tuple[int, int], concurrency: int,
            policy: RolePolicy | None) -> dict[str, Any]:
    s = simulate(costs, reqs, encode=1, prefill=pools[0], decode=pools[1], max_concurrency=concurrency,
                 role_policy=policy)
    return {"req_s": s["request_throughput"], "ttft_p99_s": s["ttft_ms"]["p99"] / 1e3,
            "completed": s["completed"], "switches": s["role_switches"]}


def sweep(num_requests: int, concurrency: int, seeds: list[int], max_tokens: int,
          policies: list[RolePolicy]) -> dict[str, Any]:
    base = Costs.load("cpu-small-llava")
    regimes = {"decode-heavy": base, "prefill-heavy": scaled(base)}
    out: dict[str, Any] = {}
    for regime, costs in regimes.items():
        for trace in ("image", "mixed", "shift"):
            for seed in seeds:
                reqs = requests(costs, trace, num_requests, seed, max_tokens)
                row = {f"fixed {k}": run_one(costs, reqs, v, concurrency, None) for k, v in FIXED.items()}
                for start, pools in SWITCH_FROM.items():
                    for p in policies:
                        row[f"{start} {label(p)}"] = run_one(costs, reqs, pools, concurrency, p)
                out[f"{regime}|{trace}|{seed}"] = row
    return out


def score(results: dict[str, Any], column: str) -> float:
    """Geometric mean over every case of (req/s relative to the best fixed layout of that case) / (TTFT p99
    relative to it): above 1, better than the best fixed layout on the mix of the two."""
    logs = []
    for row in results.values():
        best = max((v for k, v in row.items() if k.startswith("fixed")), key=lambda v: v["req_s"])
        r = row[column]
        logs.append(math.log(r["req_s"] / best["req_s"]) - math.log(r["ttft_p99_s"] / best["ttft_p99_s"]))
    return math.exp(statistics.fmean(logs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=240)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--grid", default="none", choices=(*GRIDS, "none"),
                   help="none: RolePolicy's defaults and the hand-set ones before the sweep only")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    shown = [RolePolicy(), BEFORE]
    policies = shown + ([] if args.grid == "none" else [c for c in candidates(args.grid) if c not in shown])
    results = sweep(args.num_requests, args.max_concurrency, [int(s) for s in args.seeds.split(",")],
                    args.max_tokens, policies)
    columns = list(next(iter(results.values())))
    ranked = sorted(columns, key=lambda c: score(results, c), reverse=True)
    print("score (req/s ratio / TTFT p99 ratio vs the best fixed layout, geometric mean over cases):")
    named = [c for c in columns if c.startswith("fixed") or any(label(p) in c for p in shown)]
    for c in ranked[:12] + named:
        print(f"  {score(results, c):.3f}  {c}")
    for case, row in results.items():
        print(case)
        for c in named + ranked[:2]:
            r = row[c]
            print(f"  {c:40s} {r['req_s']:.2f} req/s  TTFT p99 {r['ttft_p99_s']:.1f} s  switches {r['switches']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"policies": {label(p): dataclasses.asdict(p) for p in policies}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
