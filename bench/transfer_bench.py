"""Bandwidth of common.transfer backends between two local processes, beside an in-process copy.

Usage: python -m bench.transfer_bench [MiB] [iters]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

from common.transfer import TransferEngine

BACKENDS = ("shm", "tcp", "torch")
WARMUP = 2  # the first torch transfer also builds the pair's process group


def _sender(nbytes: int, backend: str, iters: int, to_rx: Any, from_rx: Any, report: Any) -> None:
    src = {"payload": torch.randint(0, 256, (nbytes,), dtype=torch.uint8)}
    publish_s = []
    with TransferEngine("bench-tx") as tx:
        for i in range(WARMUP + iters):
            t0 = time.perf_counter()
            desc = tx.publish(f"bench-{i}", src, backend=backend)
            publish_s.append(time.perf_counter() - t0)
            to_rx.send(desc)
            from_rx.recv()  # one transfer in flight at a time: measures bandwidth, not queueing
            while tx.pending():
                time.sleep(0.0005)
        to_rx.send(None)
    report.put(("publish", publish_s[WARMUP:]))


def _receiver(from_tx: Any, to_tx: Any, report: Any) -> None:
    fetch_s = []
    with TransferEngine("bench-rx") as rx:
        while (desc := from_tx.recv()) is not None:
            t0 = time.perf_counter()
            out = rx.fetch(desc)
            fetch_s.append(time.perf_counter() - t0)
            del out
            to_tx.send(True)
    report.put(("fetch", fetch_s[WARMUP:]))


def _copy_seconds(nbytes: int, iters: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(WARMUP + iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def measure_bandwidth(backend: str, nbytes: int, iters: int = 10) -> dict[str, Any]:
    """Move ``nbytes`` from one spawned process to another ``iters`` times through ``backend``.

    fetch_gbps: the receiver's fetch call alone (request, bytes, copy-out, ack).
    e2e_gbps: publish (staging copy on the sender) plus fetch, i.e. what a KV handoff costs.
    copy_gbps: ``dst.copy_(src)`` of the same bytes inside this process, the memcpy ceiling.
    GB/s are 1e9 bytes per second of median times.
    """
    ctx = mp.get_context("spawn")
    tx_end, rx_end = ctx.Pipe()
    ack_tx, ack_rx = ctx.Pipe()
    report = ctx.Queue()
    procs = [
        ctx.Process(target=_sender, args=(nbytes, backend, iters, tx_end, ack_tx, report)),
        ctx.Process(target=_receiver, args=(rx_end, ack_rx, report)),
    ]
    for p in procs:
        p.start()
    results = dict(report.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    publish = statistics.median(results["publish"])
    fetch = statistics.median(results["fetch"])
    copy = _copy_seconds(nbytes, iters)
    return {
        "backend": backend,
        "nbytes": nbytes,
        "iters": iters,
        "publish_ms": publish * 1e3,
        "fetch_ms": fetch * 1e3,
        "fetch_gbps": nbytes / fetch / 1e9,
        "e2e_gbps": nbytes / (publish + fetch) / 1e9,
        "copy_gbps": nbytes / copy / 1e9,
    }


def main(argv: list[str]) -> None:
    nbytes = int(float(argv[0]) * 2**20) if argv else 64 * 2**20
    iters = int(argv[1]) if len(argv) > 1 else 10
    for backend in BACKENDS:
        r = measure_bandwidth(backend, nbytes, iters)
        print(
            f"{backend:6s} {nbytes / 2**20:.0f} MiB: publish {r['publish_ms']:7.2f} ms  "
            f"fetch {r['fetch_ms']:7.2f} ms  fetch {r['fetch_gbps']:6.2f} GB/s  "
            f"end-to-end {r['e2e_gbps']:6.2f} GB/s  | in-process copy_ {r['copy_gbps']:6.2f} GB/s"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
