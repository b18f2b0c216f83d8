"""CPU use of a benchmark's own processes vs everything else on the host, sampled from /proc.

    python -m lab.cpu_monitor --match models/small-llava --out FILE.jsonl &   # then kill it
    python -m lab.cpu_monitor --summarize FILE.jsonl

Every `--interval` seconds one line: the time, the host's busy CPU jiffies (/proc/stat) and the
CPU jiffies of every process whose command line contains `--match`, with its role (coordinator,
encode/prefill/decode/unified worker, or other: the load generator). `--summarize` splits the
samples into one window per coordinator process (one per `mserve bench compare` configuration)
and reports, per window, the cores used by the cluster (workers + coordinator) and the rest of
the host ("background": the load generator and every other tenant). The scale model takes that
background as CPU the cluster did not have (`lab.sim_validate`).

    python -m lab.cpu_monitor --idle-cluster models/small-llava --cost-file COSTS.json

measures what each worker process of an idle 1e1p1d cluster uses (`cpu.worker_overhead_cores`);
`--contention MODEL` what an oversubscribed host adds to a decode step's CPU time
(`cpu.contention_factor`, applied by the simulator whenever the cluster's cores are all busy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

_ROLE = re.compile(r"--role\s+(\w+)")


def _host_busy() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


def _procs(match: str) -> dict[int, tuple[str, int]]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if match not in cmd:
                continue
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        m = _ROLE.search(cmd)
        role = m.group(1) if m else "coordinator" if " coordinator " in cmd else "other"
        out[int(d)] = (role, int(stat[11]) + int(stat[12]))
    return out


def monitor(match: str, out: Path, interval: float) -> None:
    with out.open("a") as f:
        while True:
            f.write(json.dumps({"t": time.time(), "mono": time.monotonic(), "busy": _host_busy(),
                                "procs": _procs(match)}) + "\n")
            f.flush()
            time.sleep(interval)


def summarize(path: Path, spans: list[tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """Cluster and background cores per window: one window per coordinator process seen, or the
    given `spans` (CLOCK_MONOTONIC seconds, e.g. a run's first request start to last end)."""
    hz = os.sysconf("SC_CLK_TCK")
    offset = time.time() - time.monotonic()
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for s in samples:
        s.setdefault("mono", s["t"] - offset)
    if spans is None:
        by_coord: dict[str, list[dict]] = {}
        for s in samples:
            coords = [pid for pid, (role, _) in s["procs"].items() if role == "coordinator"]
            if coords:
                by_coord.setdefault(coords[0], []).append(s)
        groups = list(by_coord.values())
    else:
        groups = [[s for s in samples if a <= s["mono"] <= b] for a, b in spans]
    out = []
    for ws in groups:
        if len(ws) < 3:
            continue
        first, last = ws[0], ws[-1]
        wall = last["mono"] - first["mono"]
        cluster = 0
        per_role: dict[str, float] = {}
        for p, (role, jif) in last["procs"].items():
            if role == "other":
                continue
            start = next((s["procs"][p][1] for s in ws if p in s["procs"]), jif)
            cluster += jif - start
            per_role[role] = per_role.get(role, 0.0) + (jif - start) / hz / wall
        busy = (last["busy"] - first["busy"]) / hz / wall
        out.append({"start": first["mono"], "end": last["mono"], "wall_s": wall,
                    "host_busy_cores": busy, "cluster_cores": cluster / hz / wall,
                    "background_cores": max(0.0, busy - cluster / hz / wall), "per_role_cores": per_role})
    return out


def idle_worker_cores(model: str, seconds: float = 15.0, settle_s: float = 5.0) -> dict[str, Any]:
    """CPU an idle 1e1p1d cluster's processes use (heartbeat thread, Redis writes, poll loop): what
    every worker costs besides its stage work. The scale model takes it off the shared cores."""
    from mserve.coordinator.launcher import LocalCluster

    hz = os.sysconf("SC_CLK_TCK")

    def jiffies(pid: int) -> int:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(stat[11]) + int(stat[12])

    with LocalCluster(model, encode=1, prefill=1, decode=1) as cluster:
        time.sleep(settle_s)  # start-up work (model load, heap freeze) is over
        procs = {name: p.pid for name, p in cluster.processes.items()}
        t0, a = time.monotonic(), {n: jiffies(pid) for n, pid in procs.items()}
        time.sleep(seconds)
        dt, b = time.monotonic() - t0, {n: jiffies(pid) for n, pid in procs.items()}
    cores = {n: (b[n] - a[n]) / hz / dt for n in procs}
    workers = [v for n, v in cores.items() if n != "coordinator"]
    return {"per_process_cores": cores, "worker_overhead_cores": sum(workers) / len(workers), "seconds": dt}


def _decode_engine(model: str) -> Any:
    """An engine holding 8 requests of ~700 tokens of context, ready to decode (one torch thread)."""
    import torch

    from mserve.common.protocol.client import Sampling
    from mserve.common.protocol.to_worker import KVState
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.hand_back import KVExport

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model, num_blocks=2048, max_num_seqs=64))
    kv = engine.runner.kv
    sampling = Sampling(max_tokens=10**6, ignore_eos=True)
    blocks = torch.randn(kv.export_shape(44), dtype=kv.dtype)
    for i in range(8):
        state = KVState(request_id=f"d{i}", prompt_ids=[5 + (i * 7 + j) % 3000 for j in range(700)], output_ids=[],
                        num_computed_tokens=699, block_size=16, images=[], sampling=sampling)
        engine.import_kv(KVExport(state, blocks), request_id=f"d{i}")
    return engine


def _compete(model: str, go: Any, stop: Any) -> None:
    engine = _decode_engine(model)
    while not stop.is_set():
        if go.is_set():
            engine.step()
        else:
            time.sleep(0.01)


def contention_factor(model: str, competitors: int = 3, steps: int = 15, rounds: int = 4) -> dict[str, Any]:
    """CPU seconds of one decode step with `competitors` other processes stepping too (the host
    oversubscribed, as in a serving run on 2 cores) over the same step with them paused, in
    alternating rounds so that other tenants' load drifts into both alike: what sharing the cores
    costs beyond the time slicing itself (caches, memory bandwidth, context switches)."""
    import multiprocessing as mp
    import statistics

    engine = _decode_engine(model)

    def per_step() -> list[float]:
        for _ in range(2):
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.process_time()
            engine.step()
            times.append(time.process_time() - t0)
        return times

    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_compete, args=(model, go, stop)) for _ in range(competitors)]
    for p in procs:
        p.start()
    time.sleep(15)  # the competitors load the model
    alone: list[float] = []
    shared: list[float] = []
    for _ in range(rounds):
        go.clear()
        time.sleep(0.5)
        alone += per_step()
        go.set()
        time.sleep(1.0)
        shared += per_step()
    stop.set()
    for p in procs:
        p.join(30)
    a, b = statistics.median(alone), statistics.median(shared)
    return {"contention_factor": b / a, "alone_step_cpu_s": a, "shared_step_cpu_s": b,
            "competitors": competitors, "host_loadavg_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--match", default="models/small-llava")
    p.add_argument("--out", default=None)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--summarize", default=None, metavar="FILE")
    p.add_argument("--idle-cluster", default=None, metavar="MODEL",
                   help="measure an idle 1e1p1d cluster's per-process CPU and, with --cost-file, store it there")
    p.add_argument("--contention", default=None, metavar="MODEL",
                   help="measure the CPU cost of an oversubscribed host (cpu.contention_factor; with --cost-file)")
    p.add_argument("--cost-file", default=None)
    args = p.parse_args(argv)
    if args.idle_cluster or args.contention:
        model = args.idle_cluster or args.contention
        res = idle_worker_cores(model) if args.idle_cluster else contention_factor(model)
        key = "worker_overhead_cores" if args.idle_cluster else "contention_factor"
        print(json.dumps(res, indent=1))
        if args.cost_file:
            data = json.loads(Path(args.cost_file).read_text())
            data["cpu"][key] = res[key]
            data["cpu"]["idle_cluster" if args.idle_cluster else "contention"] = res
            Path(args.cost_file).write_text(json.dumps(data, indent=1) + "\n")
        return 0
    if args.summarize:
        print(json.dumps(summarize(Path(args.summarize)), indent=1))
        return 0
    if not args.out:
        p.error("--out is required when monitoring")
    try:
        monitor(args.match, Path(args.out), args.interval)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
