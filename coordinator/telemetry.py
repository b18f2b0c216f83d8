"""What the coordinator measures about finished requests, for the cluster's one scrape endpoint.

Fixed-bucket histograms of each stage's latency and of TTFT / TPOT / end-to-end time, plus token
and cache counters, kept as plain numbers (no prometheus_client here: the coordinator serves
ZeroMQ, not HTTP). ``snapshot()`` rides in the STATUS reply; the gateway's /metrics renders it in
Prometheus' text format next to what the workers report.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["Histogram", "Telemetry", "LATENCY_BUCKETS_S"]

# Seconds: 1 ms .. 2 min, dense where TTFT and TPOT live.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                     2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)

# timing key in a RESULT -> histogram name
_STAGES = {"queue_s": "queue", "encode_s": "encode", "prefill_s": "prefill", "transfer_s": "transfer",
           "decode_s": "decode"}


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


class Telemetry:
    def __init__(self) -> None:
        names = [*_STAGES.values(), "ttft", "tpot", "e2e"]
        self.histograms = {name: Histogram() for name in names}
        self.counters = {"prompt_tokens": 0, "visual_tokens": 0, "generation_tokens": 0, "images": 0,
                         "embedding_cache_hits": 0, "prefix_cache_hit_tokens": 0, "images_skipped_by_prefix": 0}

    def on_result(self, timings: dict[str, float], *, arrived: float, first_token_at: float | None, now: float,
                  prompt_tokens: int, visual_tokens: int, output_tokens: int, images: int,
                  cache_hits: dict[str, int]) -> None:
        """A request that finished with a result (errors are counted by the request machine)."""
        for key, name in _STAGES.items():
            value = timings.get(key, 0.0)
            if value > 0 or key == "queue_s":
                self.histograms[name].observe(value)
        self.histograms["e2e"].observe(now - arrived)
        if first_token_at is not None:
            self.histograms["ttft"].observe(first_token_at - arrived)
            if output_tokens > 1:
                self.histograms["tpot"].observe((now - first_token_at) / (output_tokens - 1))
        c = self.counters
        c["prompt_tokens"] += prompt_tokens
        c["visual_tokens"] += visual_tokens
        c["generation_tokens"] += output_tokens
        c["images"] += images
        c["embedding_cache_hits"] += int(cache_hits.get("embedding", 0))
        c["prefix_cache_hit_tokens"] += int(cache_hits.get("prefix_tokens", 0))
        c["images_skipped_by_prefix"] += int(cache_hits.get("skipped_by_prefix", 0))

    def on_request(self, st: Any, now: float) -> None:
        """``on_result`` for a finished RequestState (coordinator/records.py)."""
        self.on_result(st.timings, arrived=st.arrived, first_token_at=st.first_token_at, now=now,
                       prompt_tokens=len(st.admitted.prompt_ids), visual_tokens=st.admitted.visual_tokens,
                       output_tokens=len(st.output_ids), images=len(st.admitted.images), cache_hits=st.cache_hits)

    def snapshot(self) -> dict[str, Any]:
        return {"histograms": {k: h.snapshot() for k, h in self.histograms.items()}, "counters": dict(self.counters)}
