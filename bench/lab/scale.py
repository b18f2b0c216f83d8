"""The 8-512 node prediction: goodput and the coordinator's ceiling with GPU-class stage costs.

    python -m lab.scale [--costs gpu-h100-llava7b-ib] [--nodes 8,16,32,64,128,256,512] \\
        [--seconds 6] [--out docs/scale-prediction]

A node is one GPU worker. Pools are split by the ratio of each stage's GPU time per request on
the trace (`stage_seconds`), at least one worker each. For every size the offered load is
`--load` (0.8) of what the same pools serve with an ideal coordinator (one that costs nothing,
measured by a closed-loop run of the 8-node unit, times N/8), Poisson, on the mixed trace. Five
coordinators are simulated: ideal (the workers' own limit), one coordinator, K shards with
sharding alone (requests partitioned, every worker heartbeating every shard at 4 Hz, least-busy
routing), K "lean" shards as designed (decode workers stream tokens to the client themselves,
heartbeats at 1 Hz, admission in stateless front ends, power of two choices: docs/scaling.md), and
K shards as mserve builds them (`BUILT`: the lean design less front-end admission, with a token
report to the shard every 16 tokens). Throughput and goodput are counted over the steady part of the run (requests
sent after the first quarter of the arrivals), so a backlog shows as lost goodput, not as a tail.
Writes OUT.json, OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from lab.sim.cluster import Cluster
from lab.sim.costs import Costs
from lab.sim.workload import from_costs

SLO_MS = {"ttft": 500.0, "tpot": 50.0}
MAX_SIMULATED_SHARDS = 64  # beyond, the as-built sharding is reported in closed form only (too many events)
LEAN = {"stream_via_coordinator": False, "heartbeat_cost_scale": 0.25, "admission_offload": True,
        "routing": "p2c"}
# What mserve implements (docs/scaling.md, "As built"): tokens to the client from the workers with a
# report every 16 tokens (--token-report-every 16), heartbeats at 1 Hz without Redis load reads
# (--heartbeat-s 1, --load-poll-s 0), power of two choices (--route-choices 2); admission stays in the shards.
BUILT = {"stream_via_coordinator": False, "token_report_every": 16, "heartbeat_cost_scale": 0.25,
         "admission_offload": False, "routing": "p2c"}


def mean_megapixels() -> float:
    from mserve.bench.images import IMAGE_RESOLUTIONS

    total = sum(w for _, w in IMAGE_RESOLUTIONS)
    return sum(wd * ht / 1e6 * w for (wd, ht), w in IMAGE_RESOLUTIONS) / total


def stage_seconds(costs: Costs, image_share: float, words: int, max_tokens: int) -> dict[str, float]:
    """Busy seconds of each stage's worker per request (full batches), for the pool split."""
    e, p = costs.data["encode"], costs.data["prefill"]
    tokens = costs.text_tokens(words) + image_share * costs.visual_tokens
    encode = image_share * (e["image_s"] + e["per_mpx_s"] * mean_megapixels() + e["batch_s"] / costs.max_encode_images)
    send, recv = costs.kv_handoff_s(int(tokens))
    prefill = (p["per_token_s"] * tokens + p["step_s"] * tokens / costs.chunk_tokens + send
               + image_share * costs.transfer_s(costs.embedding_bytes(1)))
    b = costs.max_num_seqs
    decode = (max_tokens - 1) * costs.decode_step_s(b, int(b * (tokens + max_tokens / 2))) / b + recv
    return {"encode": encode, "prefill": prefill, "decode": decode}


def split_pools(nodes: int, seconds: dict[str, float]) -> dict[str, int]:
    """Nodes per pool in proportion to `seconds` (largest remainder), at least one each."""
    total = sum(seconds.values())
    raw = {k: nodes * v / total for k, v in seconds.items()}
    pools = {k: max(1, int(v)) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - int(raw[k]), reverse=True):
        if sum(pools.values()) >= nodes:
            break
        pools[k] += 1
    while sum(pools.values()) > nodes:
        k = max(pools, key=lambda k: pools[k])
        pools[k] -= 1
    return pools


def coordinator_ceiling(costs: Costs, workers: int, image_share: float, max_tokens: int, batch: float,
                        lean: bool = False, shards: int = 1, report_every: int = 0) -> float:
    """Requests/s one coordinator (one of `shards`) takes: (1 - housekeeping share) / CPU per request.

    With K shards a decode step of `batch` requests sends one STEP_TOKENS to each shard present in
    it (min(K, batch)), so each request carries min(K, batch) times the step-message share.
    `report_every` (with `lean`): the built design, admission still in the shard, and a token report
    every N tokens, each counted as a message of its own (an upper bound)."""
    if lean and not report_every:
        from lab.sim.cluster import without_admission

        costs = without_admission(costs)
    c = costs.coord
    per_req = (image_share * costs.coord_request_cpu_s(True, max_tokens, batch)
               + (1 - image_share) * costs.coord_request_cpu_s(False, max_tokens, batch))
    per_req += c["per_step_msg_s"] * (max_tokens - 1) / batch * (min(shards, batch) - 1)
    hk = costs.coord_housekeeping_s(workers, 1.0)
    if lean:  # tokens bypass the coordinator: it sees the first token (PREFILLED) and the end only
        per_req -= c["per_token_item_s"] * (max_tokens - 2)
        per_req -= c["per_step_msg_s"] * (max_tokens - 1) / batch * min(shards, batch) - c["per_step_msg_s"]
        hk *= LEAN["heartbeat_cost_scale"]
        if report_every:
            per_req += (max_tokens - 1) // report_every * (c["per_token_item_s"] + c["per_step_msg_s"])
    return max(0.0, 1 - hk) / per_req


def shards_needed(costs: Costs, workers: int, rate: float, trace_kw: dict[str, Any], lean: bool,
                  target: float = 0.7, limit: int = 512, report_every: int = 0) -> int | None:
    """Fewest shards that keep each below `target` utilisation (None: no count does)."""
    batch = costs.max_num_seqs * 0.5
    for k in range(1, limit + 1):
        ceiling = coordinator_ceiling(costs, workers, trace_kw["image_share"], trace_kw["max_tokens"], batch,
                                      lean=lean, shards=k, report_every=report_every)
        if ceiling > 0 and rate / k <= target * ceiling:
            return k
    return None


def steady(reqs: list[Any], warm_frac: float = 0.25) -> dict[str, float]:
    """Throughput / goodput / latency over requests sent after the first `warm_frac` of the arrivals."""
    from mserve.bench.metrics import latency_stats

    last = max(q.r.arrival_s for q in reqs)
    t0 = warm_frac * last
    window = [q for q in reqs if q.r.arrival_s >= t0]
    done = [q for q in window if not math.isnan(q.end_s) and not q.shed]
    span = last - t0

    def good(q: Any) -> bool:
        return ((q.first_s - q.sent_s) * 1e3 <= SLO_MS["ttft"]
                and (q.tokens < 2 or (q.end_s - q.first_s) / (q.tokens - 1) * 1e3 <= SLO_MS["tpot"]))

    offered = len(window) / span
    ends_in = [q for q in reqs if t0 <= q.end_s <= last and not q.shed]  # NaN (unfinished) compares False
    return {"offered": offered, "throughput": len(ends_in) / span, "goodput": sum(map(good, ends_in)) / span,
            "completed_share": len(done) / len(window), "shed_share": sum(q.shed for q in window) / len(window),
            "ttft_p99_ms": latency_stats([q.first_s - q.sent_s for q in done])["p99"] if done else None}


def run_one(costs: Costs, pools: dict[str, int], rate: float, seconds: float, seed: int, trace_kw: dict[str, Any],
            coordinators: int = 1, drain_s: float = 5.0, **opts: Any) -> dict[str, Any]:
    n = max(50, int(rate * seconds))
    assert n < 2_000_000, f"{n} requests: is the capacity estimate sane? ({rate:.0f} req/s)"
    reqs = from_costs(costs, "mixed", n, seed, rate=rate, **trace_kw)
    # The shedding bound (256 by default, sized for one host) scaled with the cluster: 32 per node.
    cluster = Cluster(costs, coordinators=coordinators, max_waiting_requests=max(256, 32 * sum(pools.values())),
                      **pools, **opts)
    last = max(r.arrival_s for r in reqs)
    for c in cluster.coords:
        c.window = (0.25 * last, last)
    out = cluster.run(reqs, until_s=seconds + drain_s)
    util = max(c.busy_in for c in cluster.coords) / (0.75 * last)
    return {**steady(out), "coordinators": coordinators, "coordinator_utilisation": min(1.0, util),
            "events": cluster.loop.events}


def capacity(costs: Costs, pools: dict[str, int], seed: int, trace_kw: dict[str, Any]) -> float:
    """Requests/s the pools serve with an ideal coordinator (closed loop, enough in flight)."""
    conc = 2 * costs.max_num_seqs * pools["decode"]
    reqs = from_costs(costs, "mixed", 12 * conc, seed, **trace_kw)
    cluster = Cluster(costs, coordinator_cost_scale=0.0, max_waiting_requests=10**9, **pools)
    out = cluster.run(reqs, max_concurrency=conc)
    ends = sorted(q.end_s for q in out)
    a, b = ends[len(ends) // 4], ends[-len(ends) // 8]  # the middle of the run, after the fill
    return (len(ends) - len(ends) // 4 - len(ends) // 8) / (b - a)


def sweep(costs: Costs, nodes: list[int], seconds: float, load: float, seed: int,
          trace_kw: dict[str, Any]) -> dict[str, Any]:
    shares = stage_seconds(costs, trace_kw["image_share"], trace_kw["prompt_words"], trace_kw["max_tokens"])
    unit = split_pools(8, shares)
    cap8 = capacity(costs, unit, seed, trace_kw)
    rows = []
    for n in nodes:
        pools = split_pools(n, shares) if n != 8 else unit
        workers = sum(pools.values())
        rate = load * cap8 * n / 8
        ceil_1 = coordinator_ceiling(costs, workers, trace_kw["image_share"], trace_kw["max_tokens"],
                                     costs.max_num_seqs * 0.5)
        ceil_lean = coordinator_ceiling(costs, workers, trace_kw["image_share"], trace_kw["max_tokens"],
                                        costs.max_num_seqs * 0.5, lean=True)
        k = shards_needed(costs, workers, rate, trace_kw, lean=False)
        k_lean = shards_needed(costs, workers, rate, trace_kw, lean=True)
        k_built = shards_needed(costs, workers, rate, trace_kw, lean=True, report_every=BUILT["token_report_every"])
        row = {"nodes": n, "pools": pools, "offered": rate, "ceiling_1": ceil_1, "ceiling_lean": ceil_lean,
               "shards": k, "shards_lean": k_lean, "shards_built": k_built}
        row["ideal"] = run_one(costs, pools, rate, seconds, seed, trace_kw, coordinator_cost_scale=0.0)
        row["single"] = run_one(costs, pools, rate, seconds, seed, trace_kw)
        if k is not None and k <= MAX_SIMULATED_SHARDS:
            row["sharded"] = run_one(costs, pools, rate, seconds, seed, trace_kw, coordinators=k)
        row["lean"] = run_one(costs, pools, rate, seconds, seed, trace_kw, coordinators=k_lean, **LEAN)
        row["built"] = run_one(costs, pools, rate, seconds, seed, trace_kw, coordinators=k_built, **BUILT)
        rows.append(row)
        print(f"{n} nodes done: single {row['single']['goodput']:.0f} req/s good of {rate:.0f}", flush=True)
    return {"costs": costs.name, "unit_pools": unit, "stage_seconds": shares, "capacity_8": cap8, "load": load,
            "slo_ms": SLO_MS, "trace": trace_kw, "seconds": seconds, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    u = res["unit_pools"]
    lines = [f"Costs `{res['costs']}`; pools split {u['encode']}:{u['prefill']}:{u['decode']} (encode:prefill:decode, "
             f"from stage time per request); offered load {res['load']:.0%} of the ideal-coordinator capacity "
             f"({res['capacity_8']:.0f} req/s per 8 nodes); SLO TTFT <= {SLO_MS['ttft']:.0f} ms, TPOT <= "
             f"{SLO_MS['tpot']:.0f} ms; goodput in req/s.", "",
             "| nodes | pools E/P/D | offered req/s | goodput, ideal coordinator | 1 coordinator: throughput / "
             "goodput | 1 coordinator: ceiling req/s (closed form), utilisation | goodput, K shards, sharding alone (K) | "
             "goodput, K lean shards (K) | goodput, K shards as mserve builds them (K) |",
             "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in res["rows"]:
        p = r["pools"]
        sh = (f"{r['sharded']['goodput']:,.0f} ({r['shards']})" if "sharded" in r
              else f"needs {r['shards']} (not simulated)" if r["shards"] else "no K suffices")
        lines.append(f"| {r['nodes']} | {p['encode']}/{p['prefill']}/{p['decode']} | {r['offered']:,.0f} | "
                     f"{r['ideal']['goodput']:,.0f} | {r['single']['throughput']:,.0f} / {r['single']['goodput']:,.0f} | "
                     f"{r['ceiling_1']:,.0f}, "
                     f"{r['single']['coordinator_utilisation']:.0%} | {sh} | "
                     f"{r['lean']['goodput']:,.0f} ({r['shards_lean']}) | "
                     + (f"{r['built']['goodput']:,.0f} ({r['shards_built']}) |" if "built" in r else "- |"))
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    x = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(x, [r["offered"] for r in rows], "k:", label="offered (80 % of capacity)")
    ax.plot(x, [r["ideal"]["goodput"] for r in rows], "o-", color="C0", label="ideal coordinator (costs nothing)")
    ax.plot(x, [r["single"]["goodput"] for r in rows], "s-", color="C1", label="1 coordinator (as built)")
    ax.plot(x, [r["single"]["throughput"] for r in rows], "s:", color="C1", alpha=0.6,
            label="1 coordinator: throughput (SLOs missed)")
    ax.plot(x, [r["ceiling_1"] for r in rows], "--", color="C1", alpha=0.4, label="1 coordinator: closed-form ceiling")
    ax.plot([r["nodes"] for r in rows if "sharded" in r], [r["sharded"]["goodput"] for r in rows if "sharded" in r],
            "^-", color="C3", label="K shards, sharding alone")
    ax.plot(x, [r["lean"]["goodput"] for r in rows], "v-", color="C2",
            label="K lean shards (tokens direct, 1 Hz, front-end admission, p2c)")
    if all("built" in r for r in rows):
        ax.plot(x, [r["built"]["goodput"] for r in rows], "D--", color="C4",
                label="K shards as built (tokens direct, report every 16, 1 Hz, p2c)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_xlabel("GPU nodes (workers)")
    ax.set_ylabel(f"goodput, req/s (TTFT <= {SLO_MS['ttft']:.0f} ms, TPOT <= {SLO_MS['tpot']:.0f} ms)")
    ax.set_title(f"MServe scale model: {res['costs']} (simulated, a model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--costs", default="gpu-h100-llava7b-ib")
    p.add_argument("--nodes", default="8,16,32,64,128,256,512")
    p.add_argument("--seconds", type=float, default=6.0, help="simulated seconds of arrivals per run")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64, help="words of text per prompt")
    p.add_argument("--image-share", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/scale-prediction")
    p.add_argument("--replot", action="store_true", help="only redraw OUT.png (and OUT.md) from OUT.json")
    args = p.parse_args(argv)
    if args.replot:
        res = json.loads(Path(args.out).with_suffix(".json").read_text())
        Path(args.out).with_suffix(".md").write_text(markdown(res) + "\n")
        plot(res, Path(args.out).with_suffix(".png"))
        return 0
    costs = Costs.load(args.costs)
    trace_kw = {"image_share": args.image_share, "prompt_words": args.prompt_tokens, "max_tokens": args.max_tokens}
    res = sweep(costs, [int(n) for n in args.nodes.split(",")], args.seconds, args.load, args.seed, trace_kw)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    out.with_suffix(".md").write_text(md + "\n")
    plot(res, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
