"""KV hand-off bandwidth per transfer backend, beside an in-process copy of the same bytes.

Usage: python -m lab.transfer_bench [--iters 25] [--warmup 2] [--passes 5] [--threads 1]

One run, two spawned processes (sender and receiver, both with ``tune_malloc`` and ``--threads``
torch threads, as workers run with 1), every figure the median of ``--iters`` timed runs after
warm-up. Payloads: one request's KV on the ``small`` llava checkpoint ([8 layers, 2, 38 blocks,
4 kv heads, 16, 64] float32 = 9.5 MiB: a 597-token image prompt), and 64 MiB of the same layout.

(a) transfer: bytes / (sender starts ``publish`` -> receiver holds usable tensors), with
    ``fetch`` (copy=True: the receiver owns its memory) and ``fetch_view`` (zero-copy).
(b) pool to pool, as workers hand KV off: prefill pool -> ``export_blocks`` -> transfer ->
    ``import_blocks`` -> decode pool, against the same export + import inside one process.
(c) ``dst.copy_(src)`` of the same bytes in one process (hot, pre-allocated dst): in the sender
    process at ``--threads``, and in this parent process at torch's default thread count before
    the children start (the brief's "~0.3 ms" figure is the latter on a 2-core host).
(d) raw loopback tcp for the same bytes: zmq PAIR (copy=False; 1 frame, 4 frames, 4 MiB socket
    buffers) and a plain socket (sendall -> recv_into a pre-allocated buffer): the tcp ceiling.

Remote times include handing the descriptor over a multiprocessing Pipe (its ``to_wire()``
dict, which the receiver's fetch parses as it would off the control plane; one-way latency
printed). GB/s are 1e9 bytes per second of the median time; percentages compare medians.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

from lab import transfer_bench_procs as procs


def _hot_copy_s(shape: tuple[int, ...], iters: int) -> float:
    src = torch.randn(shape)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ms(v: float) -> str:
    return f"{v * 1e3:.3f}"


def report(res: dict[str, Any], parent_copy: dict[str, float], parent_threads: int) -> str:
    times = res["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    iqr = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
    n = len(next(iter(times.values())))
    thr = res["threads"]
    out = [f"Median of {n} timed runs per path; sender/receiver at {thr} torch thread(s); "
           f"descriptor hand-off over the Pipe {med[('misc', 'pipe')] * 1e6:.0f} us one-way.", ""]
    head = ["payload", "path", "median ms", "p25-p75 ms", "GB/s",
            f"% of copy_ ({thr} thr)", f"% of copy_ ({parent_threads} thr)"]
    out += [_row(head), _row(["---"] * len(head))]
    for size, shape in procs.SIZES.items():
        nb = procs.nbytes(shape)
        label = f"{nb / 2**20:.1f} MiB" + (" = 1 request's KV" if size == "kv" else "")
        base = med[(size, "(c) dst.copy_(src), in-process")]
        rows = [(p, m) for (s, p), m in med.items() if s == size]
        rows.insert(1, (f"(c) dst.copy_(src), in-process, {parent_threads} threads", parent_copy[size]))
        for path, m in rows:
            spread = iqr.get((size, path))
            spread_s = f"{_ms(spread[0])}-{_ms(spread[2])}" if spread else ""
            if path == "(c) dst.copy_(src), in-process":
                path = f"(c) dst.copy_(src), in-process, {thr} thread(s)"
            out.append(_row([label, path, _ms(m), spread_s, f"{nb / m / 1e9:.2f}",
                             f"{100 * base / m:.0f}%", f"{100 * parent_copy[size] / m:.0f}%"]))
    kv_bytes = procs.nbytes(procs.KV_SHAPE)
    out += ["", "(b) pool to pool, one request's KV: export_blocks -> transfer -> import_blocks", ""]
    head = ["path", "median ms", "p25-p75 ms", "GB/s", "% of in-process"]
    out += [_row(head), _row(["---"] * len(head))]
    base = med[("pool", "in-process export + import")]
    for (s, path), m in med.items():
        if s == "pool":
            q = iqr[(s, path)]
            out.append(_row([path, _ms(m), f"{_ms(q[0])}-{_ms(q[2])}", f"{kv_bytes / m / 1e9:.2f}",
                             f"{100 * base / m:.0f}%"]))
    pool = res["pool"]
    out += ["", f"Sender's shm pool after the run: {pool['created']} segments created, "
            f"{pool['reused']} reuses, {pool['retained_bytes'] / 2**20:.0f} MiB retained."]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=25, help="timed runs per path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each block")
    ap.add_argument("--passes", type=int, default=5, help="blocks per path (iters split among them)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in the two processes (workers default to 1)")
    args = ap.parse_args(argv)
    from mserve.common.perf import tune_malloc

    tune_malloc()
    parent_copy = {k: _hot_copy_s(s, args.iters) for k, s in procs.SIZES.items()}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tx_rx, rx_tx = ctx.Pipe()
    workers = [
        ctx.Process(target=procs.sender,
                    args=(child, tx_rx, args.warmup, args.iters, args.passes, args.threads)),
        ctx.Process(target=procs.receiver, args=(rx_tx, args.threads)),
    ]
    res = procs.run_pair(workers, parent, "benchmark")
    print(report(res, parent_copy, torch.get_num_threads()))


if __name__ == "__main__":
    main(sys.argv[1:])
