"""What the coordinator measures about finished requests, for the cluster's one scrape endpoint.

Fixed-bucket histograms of each stage's latency and of TTFT / TPOT / end-to-end time, plus token
and cache counters, kept as plain numbers (no prometheus_client here: the coordinator serves
ZeroMQ, not HTTP). ``snapshot()`` rides in the STATUS reply; the gateway's /metrics renders it in
Prometheus' text format next to what the workers report.
"""

from __future__ import annotations

from typing import Any

from mserve.common.histogram import LATENCY_BUCKETS_S, STEP_BUCKETS_S, TOKEN_BUCKETS, Histogram

__all__ = ["Histogram", "Telemetry", "LATENCY_BUCKETS_S", "STEP_BUCKETS_S", "TOKEN_BUCKETS", "modality"]

# timing key in a RESULT -> histogram name
_STAGES = {"queue_s": "queue", "encode_s": "encode", "prefill_s": "prefill", "transfer_s": "transfer",
           "decode_s": "decode"}


def modality(images: Any) -> str:
    """A request's modality label: "video" or "audio" when any item is one (video first), "image" when it has
    images, else "text"."""
    kinds = {im.kind for im in images}
    return next((k for k in ("video", "audio", "image") if k in kinds), "text")


class Telemetry:
    """One model's numbers (each served model has its own request machine): the unlabelled histograms and
    counters, and ``labelled`` histograms keyed "stage|modality" (queue wait) or "modality"."""

    def __init__(self) -> None:
        names = [*_STAGES.values(), "ttft", "tpot", "e2e"]
        self.histograms = {name: Histogram() for name in names}
        self.counters = {"prompt_tokens": 0, "visual_tokens": 0, "generation_tokens": 0, "images": 0,
                         "embedding_cache_hits": 0, "prefix_cache_hit_tokens": 0, "images_skipped_by_prefix": 0,
                         # lookups in the cluster's Redis index at routing (coordinator/dispatch.py)
                         "redis_embedding_lookups": 0, "redis_embedding_lookup_hits": 0,
                         "redis_prefix_lookups": 0, "redis_prefix_lookup_hits": 0}
        self.labelled: dict[str, dict[str, Histogram]] = {"queue_wait": {}, "encode_forward": {},
                                                          "visual_tokens_per_item": {}, "ttft": {}, "tpot": {},
                                                          "e2e": {}, "stage_time": {}, "encode_preprocess": {}}

    def _labelled(self, kind: str, key: str, buckets: tuple[float, ...]) -> Histogram:
        h = self.labelled[kind].get(key)
        if h is None:
            h = self.labelled[kind][key] = Histogram(buckets)
        return h

    def on_dispatch(self, stage: str, modality_: str, queued_s: float) -> None:
        """A stage left the coordinator's queue for a worker after ``queued_s`` there."""
        self._labelled("queue_wait", f"{stage}|{modality_}", LATENCY_BUCKETS_S).observe(queued_s)

    def on_encoded(self, modality_: str, worker_s: float, preprocess_s: float = 0.0) -> None:
        """An encode worker's time on one request's images (decode, vision forward, pruning), and its batch's
        preprocessing (decoding, resampling) when it had new items to encode."""
        self._labelled("encode_forward", modality_, STEP_BUCKETS_S).observe(worker_s)
        if preprocess_s > 0:
            self._labelled("encode_preprocess", modality_, STEP_BUCKETS_S).observe(preprocess_s)

    def on_result(self, timings: dict[str, float], *, arrived: float, first_token_at: float | None, now: float,
                  prompt_tokens: int, visual_tokens: int, output_tokens: int, images: int,
                  cache_hits: dict[str, int], item_tokens: tuple[tuple[str, int], ...] = (),
                  latency_class: str = "interactive", modality_: str = "text") -> None:
        """A request that finished with a result (errors are counted by the request machine). Each stage's
        time, and TTFT, TPOT and end-to-end time, go in twice: unlabelled, and by the request's modality (the
        stages: encode and embedding transfer per modality) or latency class."""
        for key, name in _STAGES.items():
            value = timings.get(key, 0.0)
            if value > 0 or key == "queue_s":
                self.histograms[name].observe(value)
                self._labelled("stage_time", f"{name}|{modality_}", LATENCY_BUCKETS_S).observe(value)
        latencies = {"e2e": now - arrived}
        if first_token_at is not None:
            latencies["ttft"] = first_token_at - arrived
            if output_tokens > 1:
                latencies["tpot"] = (now - first_token_at) / (output_tokens - 1)
        for key, value in latencies.items():
            self.histograms[key].observe(value)
            self._labelled(key, latency_class, LATENCY_BUCKETS_S).observe(value)
        c = self.counters
        for kind, tokens in item_tokens:
            self._labelled("visual_tokens_per_item", kind, TOKEN_BUCKETS).observe(tokens)
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
                       output_tokens=len(st.output_ids), images=len(st.admitted.images), cache_hits=st.cache_hits,
                       item_tokens=tuple((im.kind, im.num_tokens) for im in st.admitted.images),
                       latency_class=st.admitted.request.latency_class, modality_=modality(st.admitted.images))

    def snapshot(self) -> dict[str, Any]:
        return {"histograms": {k: h.snapshot() for k, h in self.histograms.items()}, "counters": dict(self.counters),
                "labelled": {kind: {key: h.snapshot() for key, h in hs.items()} for kind, hs in self.labelled.items()}}
