"""`python -m lab.simulate`: the scale model, a discrete-event simulation of an MServe cluster.

    python -m lab.simulate --costs cpu-small-llava --configs disagg:1e1p1d,disagg:2e2p2d \\
        --trace image --num-requests 100 --rate 0.8 --max-tokens 64 --seed 0 --slo ttft=2000,tpot=100

Same trace flags as `mserve bench serve` (the same seeded arrivals, image sizes and classes; see
bench/lab/sim/workload.py); the costs come from a cost file (bench/lab/costs/: `cpu-*.json`
measured by `python -m lab.calibrate`, `gpu-*.json` derived from stated assumptions by
`python -m lab.sim.gpu_costs`). Prints throughput, goodput, TTFT / TPOT percentiles and
the coordinator's utilisation per configuration. Deterministic for a seed. The model is described
in bench/lab/sim/cluster.py; the scale sweep is `python -m lab.scale`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from typing import Any

from mserve.bench.metrics import latency_stats
from lab.sim.cluster import Cluster, Req
from lab.sim.costs import Costs
from lab.sim.workload import SimRequest, from_costs

_CONFIG = re.compile(r"^disagg:(\d+)e(\d+)p(\d+)d(?:@(\d+)c)?$")


def parse_config(text: str) -> dict[str, int]:
    """`disagg:XeYpZd` (optionally `@Kc`: K sharded coordinators) -> pool sizes."""
    m = _CONFIG.match(text.strip())
    if not m:
        raise ValueError(f"{text!r}: expected disagg:XeYpZd or disagg:XeYpZd@Kc")
    e, p, d, k = m.groups()
    return {"encode": int(e), "prefill": int(p), "decode": int(d), "coordinators": int(k or 1)}


def summarize(reqs: list[Req], cluster: Cluster, slo_ms: dict[str, float], wall_s: float) -> dict[str, Any]:
    done = [q for q in reqs if not math.isnan(q.end_s) and not q.shed]
    if not done:
        return {"completed": 0, "count": len(reqs), "shed": sum(q.shed for q in reqs)}
    start, end = min(q.sent_s for q in done), max(q.end_s for q in done)
    duration = max(end - start, 1e-9)
    ttft = [q.first_s - q.sent_s for q in done]
    tpot = [(q.end_s - q.first_s) / (q.tokens - 1) for q in done if q.tokens > 1]

    def good(q: Req) -> bool:
        if "ttft" in slo_ms and (q.first_s - q.sent_s) * 1e3 > slo_ms["ttft"]:
            return False
        if "tpot" in slo_ms and q.tokens > 1 and (q.end_s - q.first_s) / (q.tokens - 1) * 1e3 > slo_ms["tpot"]:
            return False
        if "e2e" in slo_ms and (q.end_s - q.sent_s) * 1e3 > slo_ms["e2e"]:
            return False
        return True

    busy = cluster.cpu.busy_s if cluster.coord_cpu is cluster.cpu else {**cluster.cpu.busy_s,
                                                                         **cluster.coord_cpu.busy_s}
    roles: dict[str, list[float]] = {}
    for w in cluster.workers:
        roles.setdefault(w.role, []).append(busy.get(w.wid, 0.0) / duration)
    coord_util = [busy.get(c.owner, 0.0) / duration for c in cluster.coords]
    return {
        "count": len(reqs), "completed": len(done), "shed": sum(q.shed for q in reqs), "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(q.tokens for q in done) / duration,
        "goodput": sum(map(good, done)) / duration if slo_ms else None,
        "ttft_ms": latency_stats(ttft), "tpot_ms": latency_stats(tpot),
        "e2e_ms": latency_stats([q.end_s - q.sent_s for q in done]),
        "coordinator_utilisation": max(coord_util), "coordinator_messages_per_s":
            sum(c.messages for c in cluster.coords) / duration,
        "coordinator_max_queue": max(c.max_queue for c in cluster.coords),
        "worker_cpu_per_role": {r: sum(v) / len(v) for r, v in roles.items()},
        "prompts_lent": sum(c.lent for c in cluster.coords),
        "role_switches": [(round(t, 1), wid, role) for t, wid, role in cluster.roles.switches] if cluster.roles else [],
        "events": cluster.loop.events, "sim_wall_s": wall_s,
    }


def simulate(costs: Costs, requests: list[SimRequest], *, encode: int = 1, prefill: int = 1, decode: int = 1,
             coordinators: int = 1, max_concurrency: int | None = None, slo_ms: dict[str, float] | None = None,
             until_s: float = math.inf, **cluster_options: Any) -> dict[str, Any]:
    """One configuration over one request list; returns the summary. `cluster_options`: the other
    `Cluster` fields (coordinator_cost_scale, stream_via_coordinator, heartbeat_cost_scale,
    local_prefill_tokens, role_policy)."""
    t0 = time.perf_counter()
    cluster = Cluster(costs, encode=encode, prefill=prefill, decode=decode, coordinators=coordinators,
                      **cluster_options)
    reqs = cluster.run(requests, max_concurrency=max_concurrency, until_s=until_s)
    return summarize(reqs, cluster, slo_ms or {}, time.perf_counter() - t0)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    metrics = [("completed", ("completed",)), ("req/s", ("request_throughput",)), ("goodput req/s", ("goodput",)),
               ("TTFT p50 ms", ("ttft_ms", "p50")), ("TTFT p99 ms", ("ttft_ms", "p99")),
               ("TPOT p50 ms", ("tpot_ms", "p50")), ("TPOT p99 ms", ("tpot_ms", "p99")),
               ("prompts lent to decode", ("prompts_lent",)),
               ("coordinator utilisation", ("coordinator_utilisation",)),
               ("coordinator msgs/s", ("coordinator_messages_per_s",))]
    out = ["| metric | " + " | ".join(label for label, _ in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, path in metrics:
        cells = []
        for _, s in rows:
            v: Any = s
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            cells.append(_fmt(v))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    from mserve.bench.serve import parse_slo

    p.add_argument("--trace", default="image", choices=("text", "image", "mixed"))
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=math.inf, help="req/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64, help="words of text per prompt, as bench serve")
    p.add_argument("--image-share", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", type=parse_slo, default={}, metavar="ttft=MS,tpot=MS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--costs", default="cpu-small-llava", help="cost file, or a name in bench/lab/costs/")
    p.add_argument("--configs", default="disagg:1e1p1d", help="comma-separated disagg:XeYpZd[@Kc]")
    add_trace_arguments(p)
    p.add_argument("--local-prefill-tokens", type=int, default=Cluster.local_prefill_tokens,
                   help="the coordinator's --local-prefill-tokens: lend prompts to decode workers once a prefill "
                        f"worker has this many prompt tokens waiting (default {Cluster.local_prefill_tokens}, the "
                        "coordinator's; 0: never)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    costs = Costs.load(args.costs)
    reqs = from_costs(costs, args.trace, args.num_requests, args.seed, prompt_words=args.prompt_tokens,
                      rate=args.rate, burstiness=args.burstiness, image_share=args.image_share,
                      max_tokens=args.max_tokens)
    rows = []
    for cfg in args.configs.split(","):
        pools = parse_config(cfg)
        rows.append((cfg, simulate(costs, reqs, max_concurrency=args.max_concurrency, slo_ms=args.slo,
                                   local_prefill_tokens=args.local_prefill_tokens, **pools)))
    print(f"costs {costs.name}; trace {args.trace}, {args.num_requests} requests, rate {args.rate}, "
          f"max_concurrency {args.max_concurrency}, max_tokens {args.max_tokens}, seed {args.seed}")
    print(table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(rows), f, indent=1)
    print(f"simulated in {sum(s.get('sim_wall_s', 0) for _, s in rows):.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
