"""Fixed-bucket histograms kept as plain numbers, and the bucket bounds the cluster's metrics use.

The coordinator keeps them per request (coordinator/telemetry.py) and workers per engine step (their
heartbeat load carries ``snapshot()``); the gateway's /metrics renders the snapshots in Prometheus'
text format (mserve/gateway/metrics.py). No prometheus_client here: neither process serves HTTP.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["Histogram", "LATENCY_BUCKETS_S", "STEP_BUCKETS_S", "TOKEN_BUCKETS"]

# Seconds: 1 ms .. 2 min, dense where TTFT and TPOT live.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                     2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)

# Seconds: one engine step or one vision forward, 0.5 ms (a tiny model's decode step on a CPU) .. 10 s.
STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0, 10.0)
# Visual tokens of one image or video: a tiny checkpoint's 4 .. a long video's thousands.
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 576, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Cumulative-ready bucket counts (upper bounds ``le``), their sum and count."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.le = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.le, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        return {"le": list(self.le), "counts": list(self.counts), "sum": round(self.sum, 6), "count": self.count}
