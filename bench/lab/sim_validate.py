"""Simulator vs measured: replay the load of `mserve bench compare` runs in the scale model, side by side.

    python -m lab.sim_validate --costs cpu-small-llava out/sim-validate/poisson out/sim-validate/closed

Each argument is a `mserve bench compare --out` folder. For every `disagg:XeYpZd` configuration
in it the simulator gets the same trace parameters (trace name, request count, rate, burstiness,
seed, max concurrency from the run's results.json; max_tokens from its trace.jsonl; SLOs from
the run) and the same pools, and the table puts predicted next to measured throughput, goodput,
TTFT and TPOT, with the error of the prediction in percent. A `cpu.jsonl` in the folder (written by
`python -m lab.cpu_monitor` during the run) gives, per configuration, the CPU the rest of
the host used (load generator, other tenants): the simulator's CPU pool gets that much less.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from mserve.bench.report import at_path

from lab.sim.costs import Costs
from lab.sim.workload import from_costs
from lab.simulate import parse_config, simulate

FIGURES = (("req/s", ("request_throughput",)), ("goodput req/s", ("goodput",)),
           ("TTFT p50 ms", ("ttft_ms", "p50")), ("TTFT p99 ms", ("ttft_ms", "p99")),
           ("TPOT p50 ms", ("tpot_ms", "p50")), ("TPOT p99 ms", ("tpot_ms", "p99")))


def _max_tokens(trace_path: Path) -> int:
    with trace_path.open() as f:
        return int(json.loads(f.readline())["max_tokens"])


def with_background(costs: Costs, cores: float) -> Costs:
    return Costs({**costs.data, "cpu": {**costs.data["cpu"], "background_cores": cores}})


def validate_run(costs: Costs, run_dir: Path) -> list[dict[str, Any]]:
    """Every disagg configuration of one compare folder; with its cpu.jsonl (lab.cpu_monitor, one
    window per configuration, in order) the CPU the rest of the host used is taken from the cluster."""
    from lab.cpu_monitor import summarize as cpu_windows

    rows = []
    max_tokens = _max_tokens(run_dir / "trace.jsonl")
    subs = sorted((p for p in run_dir.iterdir() if p.is_dir() and (p / "results.json").exists()),
                  key=lambda p: int(p.name.split("-", 1)[0]))
    for sub in subs:
        res = json.loads((sub / "results.json").read_text())
        meta, summary = res["meta"], res["summary"]["overall"]
        try:
            pools = parse_config(meta["config"])
        except ValueError:
            continue  # only disaggregated configurations are modelled
        recs = res["records"]  # the traffic period, on the monitor's clock (CLOCK_MONOTONIC)
        span = (min(r["start_s"] for r in recs), max(r["end_s"] or r["start_s"] for r in recs))
        windows = cpu_windows(run_dir / "cpu.jsonl", [span]) if (run_dir / "cpu.jsonl").exists() else []
        window = windows[0] if windows else None
        run_costs = with_background(costs, window["background_cores"]) if window else costs
        rate = math.inf if meta["rate"] in (None, "inf") else float(meta["rate"])
        reqs = from_costs(costs, meta["trace"], int(meta["num_requests"]), int(meta["seed"]), rate=rate,
                          burstiness=float(meta.get("burstiness", 1.0)), max_tokens=max_tokens)
        slo = summary.get("slos_ms") or {}
        sim = simulate(run_costs, reqs, max_concurrency=meta.get("max_concurrency"), slo_ms=slo, **pools)
        rows.append({"run": run_dir.name, "config": meta["config"], "rate": meta["rate"],
                     "max_concurrency": meta.get("max_concurrency"), "host_load": meta.get("host_loadavg_1m"),
                     "background_cores": run_costs.data["cpu"].get("background_cores"),
                     "measured_cluster_cores": window["cluster_cores"] if window else None,
                     "measured_per_role_cores": window["per_role_cores"] if window else None,
                     "measured": {k: at_path(summary, p) for k, p in FIGURES},
                     "predicted": {k: at_path(sim, p) for k, p in FIGURES},
                     "coordinator_utilisation": sim["coordinator_utilisation"],
                     "worker_cpu_per_role": sim["worker_cpu_per_role"]})
    return rows


def _err(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{100 * (pred - meas) / meas:+.0f}%"


def markdown(rows: list[dict[str, Any]], figures: tuple[str, ...] = ("req/s", "TTFT p99 ms")) -> str:
    head = ["run", "config", "load", "background cores"]
    for f in figures:
        head += [f"{f} measured", "predicted", "error"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        load = f"conc {r['max_concurrency']}" if r["max_concurrency"] else f"{r['rate']} req/s"
        cells = [r["run"], r["config"], load, f"{r['background_cores']:.2f}"]
        for f in figures:
            m, p = r["measured"][f], r["predicted"][f]
            cells += [f"{m:,.3g}" if m is not None else "-", f"{p:,.3g}" if p is not None else "-", _err(p, m)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def fit_overhead(row: dict[str, Any], pools: dict[str, int]) -> dict[str, float]:
    """Per worker of each role: the cores the live workers used (cpu.jsonl) beyond the stage work the
    simulator charges at the measured throughput (heartbeats, message handling, streaming)."""
    thr_m, thr_s = row["measured"]["req/s"], row["predicted"]["req/s"]
    out = {}
    for role, n in pools.items():
        if role == "coordinators" or role not in row["worker_cpu_per_role"]:
            continue
        work_per_req = row["worker_cpu_per_role"][role] * n / thr_s
        out[role] = max(0.0, (row["measured_per_role_cores"][role] - work_per_req * thr_m) / n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--costs", default="cpu-small-llava")
    p.add_argument("runs", nargs="+", help="mserve bench compare --out folders")
    p.add_argument("--json-out", default=None)
    p.add_argument("--fit-overhead", default=None, metavar="RUN/CONFIG",
                   help="fit cpu.worker_overhead_cores from this run's configuration (e.g. closed/disagg:1e1p1d) "
                        "and write it into --costs (a file path), then validate")
    args = p.parse_args(argv)
    costs = Costs.load(args.costs)
    if args.fit_overhead:
        run, config = args.fit_overhead.split("/", 1)
        run_dir = next(Path(r) for r in args.runs if Path(r).name == run)
        data = {**costs.data, "cpu": {**costs.data["cpu"], "worker_overhead_cores": 0.0}}
        row = next(r for r in validate_run(Costs(data), run_dir) if r["config"] == config)
        fitted = fit_overhead(row, parse_config(config))
        costs.data["cpu"]["worker_overhead_cores"] = fitted
        costs.data["cpu"]["worker_overhead_fit"] = (f"fitted on {run_dir}/{config}: live workers' CPU (cpu.jsonl) "
                                                    "less the stage work simulated at the measured throughput")
        Path(args.costs).write_text(json.dumps(costs.data, indent=1) + "\n")
        print(f"worker_overhead_cores = {fitted}")
    rows = [row for run in args.runs for row in validate_run(costs, Path(run))]
    print(markdown(rows))
    print()
    print(markdown(rows, ("goodput req/s", "TTFT p50 ms", "TPOT p50 ms", "TPOT p99 ms")))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
