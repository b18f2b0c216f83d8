"""The cluster's one Prometheus scrape endpoint: what the gateway saw, plus what the coordinator reports.

At each scrape the gateway asks the coordinator for STATUS (workers' load and engine counters from
their heartbeats, the coordinator's request counters and latency histograms) and renders it next
to its own HTTP-level metrics. Names follow Prometheus conventions (``mserve_`` prefix, base units,
``_total`` counters, ``_seconds`` / ``_bytes``); docs/operations.md lists them all.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from mserve.common.protocol.to_coordinator import WorkerLoad
from mserve.coordinator.telemetry import LATENCY_BUCKETS_S

__all__ = ["GatewayMetrics", "WORKER_GAUGES", "WORKER_COUNTERS"]

# WorkerLoad field -> (metric name, help, scale); a name that is not a field fails at import.
WORKER_GAUGES = {
    "queue_len": ("mserve_worker_queue_depth", "Requests queued at the worker, not started", 1),
    "running": ("mserve_worker_running_requests", "Requests running on the worker", 1),
    "free_blocks": ("mserve_worker_kv_blocks_free", "Free KV blocks in the worker's pool", 1),
    "total_blocks": ("mserve_worker_kv_blocks_total", "KV blocks in the worker's pool", 1),
    "tokens_per_s": ("mserve_worker_tokens_per_second", "Tokens per second the worker produced (EWMA)", 1),
    "rss_mib": ("mserve_worker_resident_memory_bytes", "Resident memory of the worker process", 2**20),
    "weights_mib": ("mserve_worker_weights_bytes", "Model weights the worker holds (on its device)", 2**20),
    "kv_pool_mib": ("mserve_worker_kv_pool_bytes", "The worker's KV pool (on its device)", 2**20),
}
assert WORKER_GAUGES.keys() <= WorkerLoad.__dataclass_fields__.keys(), "a gauge names no WorkerLoad field"
# engine counter -> (metric name without _total, help, kind)
WORKER_COUNTERS = {
    "encoded_images": ("mserve_worker_encoded_images", "Images run through the vision tower", "counter"),
    "visual_tokens": ("mserve_worker_visual_tokens", "Visual tokens the vision tower produced", "counter"),
    "embedding_cache_hits": ("mserve_worker_embedding_cache_hits", "Images served from the embedding cache",
                             "counter"),
    "embedding_l1_hits": ("mserve_worker_embedding_l1_hits", "Images served from the encode worker's own cache (L1)",
                          "counter"),
    "embedding_l2_hits": ("mserve_worker_embedding_l2_hits", "Images served from the host's shared cache (L2)",
                          "counter"),
    "embedding_l1_evictions": ("mserve_worker_embedding_l1_evictions", "Embeddings dropped from the worker's own "
                               "cache (L1) to make room", "counter"),
    "embedding_l2_evictions": ("mserve_worker_embedding_l2_evictions", "Embeddings dropped from the host's shared "
                               "cache (L2) to make room", "counter"),
    "embedding_l1_bytes": ("mserve_worker_embedding_l1_bytes", "Bytes of embeddings in the worker's own cache (L1)",
                           "gauge"),
    "embedding_l2_bytes": ("mserve_worker_embedding_l2_bytes", "Bytes of embeddings in the host's shared cache (L2), "
                           "as this worker last wrote it", "gauge"),
    "state_snapshot_bytes": ("mserve_worker_state_snapshot_bytes", "Bytes of a hybrid model's state copies kept "
                             "for prefix hits (linear-attention layers)", "gauge"),
    "state_snapshots_restored": ("mserve_worker_state_snapshots_restored", "Prefix hits of a hybrid model resumed "
                                 "from a state copy", "counter"),
    "encodes_skipped_by_prefix": ("mserve_worker_encodes_skipped_by_prefix",
                                  "Images not encoded: the cached prefix held their placeholders", "counter"),
    "prefix_skip_fallbacks": ("mserve_worker_prefix_skip_fallbacks",
                              "Images skipped for the prefix, then encoded after all (its blocks were evicted)",
                              "counter"),
    "prefill_tokens": ("mserve_worker_prefill_tokens", "Prompt tokens prefilled", "counter"),
    "decode_tokens": ("mserve_worker_decode_tokens", "Tokens decoded", "counter"),
    "steps": ("mserve_worker_engine_steps", "Engine steps (forward passes)", "counter"),
    "prefix_hits": ("mserve_worker_prefix_cache_hits", "Prompt blocks found in the prefix cache", "counter"),
    "prefix_queries": ("mserve_worker_prefix_cache_queries", "Prompt blocks looked up in the prefix cache",
                       "counter"),
    "preemptions": ("mserve_worker_preemptions", "Requests preempted when KV blocks ran out", "counter"),
    "used_blocks": ("mserve_worker_kv_blocks_used", "KV blocks held by requests", "gauge"),
    "cached_blocks": ("mserve_worker_kv_blocks_cached", "Free KV blocks still holding a reusable prefix", "gauge"),
    "indexed_blocks": ("mserve_worker_kv_blocks_indexed", "KV blocks in the cluster's prefix index (held or cached)",
                       "gauge"),
    "prefix_evictions": ("mserve_worker_prefix_cache_evictions", "Cached prefix blocks reused for other tokens",
                         "counter"),
    "batch_size": ("mserve_worker_batch_size", "Sequences in the worker's latest engine step", "gauge"),
}
_COORDINATOR_STATS = {
    "admitted": "Requests admitted", "rejected": "Requests refused at admission (invalid or over a limit)",
    "completed": "Requests that ended with a result", "failed": "Requests that ended with an error after admission",
    "reruns": "Stages re-run after a worker failed or went silent", "shed": "Requests shed with an overloaded error",
    "encode_deduplicated": "Images a request read back from another request's encode instead of encoding again",
    "pruned_adaptive": "Requests admitted with their images pruned by SLO-adaptive pruning",
}
# coordinator/telemetry.py's labelled histograms, per model: kind -> (name, help, labels its key holds, "|"-joined)
_LABELLED = {
    "queue_wait": ("mserve_model_stage_queue_wait_seconds",
                   "Time a stage waited in the coordinator's queue for a worker", ["stage", "modality"]),
    "encode_forward": ("mserve_model_encode_worker_seconds",
                       "An encode worker's time on one request's items (decoding, vision or audio tower)", ["modality"]),
    "visual_tokens_per_item": ("mserve_model_item_visual_tokens", "Placeholder tokens of one image, video or "
                               "audio clip of a completed request", ["modality"]),
    "encode_preprocess": ("mserve_model_encode_preprocess_seconds", "An encode worker's decoding / resampling of "
                          "a batch's new items (preprocessing), per request", ["modality"]),
    "stage_time": ("mserve_model_request_stage_seconds", "Time a completed request spent per stage (encode, "
                   "embedding transfer...), by the request's modality", ["stage", "modality"]),
    "ttft": ("mserve_model_time_to_first_token_seconds", "Arrival to first token, per model and latency class",
             ["class"]),
    "tpot": ("mserve_model_time_per_output_token_seconds", "Per token after the first, per model and latency class",
             ["class"]),
    "e2e": ("mserve_model_e2e_request_latency_seconds", "Arrival to result, per model and latency class", ["class"]),
}
_TELEMETRY_COUNTERS = {
    "prompt_tokens": "Prompt tokens of completed requests (visual included)",
    "visual_tokens": "Visual tokens of completed requests",
    "generation_tokens": "Tokens generated for completed requests",
    "images": "Images in completed requests",
    "embedding_cache_hits": "Images of completed requests whose embeddings came from a cache",
    "prefix_cache_hit_tokens": "Prompt tokens of completed requests whose KV came from the prefix cache",
    "images_skipped_by_prefix": "Images of completed requests not encoded: the cached prefix held them",
    "redis_embedding_lookups": "Lookups of an item's embedding holders in the cluster's Redis index, at routing",
    "redis_embedding_lookup_hits": "Redis embedding-index lookups that found a holder",
    "redis_prefix_lookups": "Lookups of a prompt's prefix blocks in the cluster's Redis index, at routing",
    "redis_prefix_lookup_hits": "Redis prefix-index lookups that found a worker holding leading blocks",
}


def _histogram(name: str, help_: str, snap: dict[str, Any], labels: dict[str, str] | None = None,
               family: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
    labels = labels or {}
    family = family or HistogramMetricFamily(name, help_, labels=list(labels))
    total, buckets = 0, []
    for le, n in zip([*snap["le"], float("inf")], snap["counts"]):
        total += n
        buckets.append(("+Inf" if le == float("inf") else repr(float(le)), total))
    family.add_metric(list(labels.values()), buckets, snap["sum"])
    return family


class ClusterCollector:
    """Renders the latest coordinator STATUS as metric families (nothing when it was unavailable)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        up = GaugeMetricFamily("mserve_coordinator_up", "1 when the coordinator answered this scrape's STATUS")
        up.add_metric([], 0 if status is None else 1)
        yield up
        if status is None:
            return
        yield from self._workers(status.get("workers") or {}, status.get("roles") or {})
        yield GaugeMetricFamily("mserve_requests_in_flight", "Requests admitted and not ended",
                                value=status.get("requests_in_flight", 0))
        if isinstance(status.get("rss_mib"), (int, float)):
            yield GaugeMetricFamily("mserve_coordinator_resident_memory_bytes", "Resident memory of the coordinator",
                                    value=status["rss_mib"] * 2**20)
        for key, help_ in _COORDINATOR_STATS.items():
            yield CounterMetricFamily(f"mserve_requests_{key}", help_, value=(status.get("stats") or {}).get(key, 0))
        switches = status.get("role_switching") or {}  # coordinator/role_switching.py
        yield CounterMetricFamily("mserve_role_switches", "Workers that switched role: drained, reloaded, rejoined",
                                  value=switches.get("completed", 0))
        yield CounterMetricFamily("mserve_role_switches_dropped", "Role switches abandoned: the worker died or came "
                                  "back with another role", value=switches.get("dropped", 0))
        tele = status.get("telemetry") or {}
        for key, help_ in _TELEMETRY_COUNTERS.items():
            yield CounterMetricFamily(f"mserve_{key}", help_, value=(tele.get("counters") or {}).get(key, 0))
        hist = tele.get("histograms") or {}
        stages = HistogramMetricFamily("mserve_request_stage_seconds", "Time a completed request spent per stage",
                                       labels=["stage"])
        for stage in ("queue", "encode", "prefill", "transfer", "decode"):
            if stage in hist:
                _histogram("", "", hist[stage], {"stage": stage}, stages)
        yield stages
        for key, name, help_ in (("ttft", "mserve_time_to_first_token_seconds", "Arrival to first token"),
                                 ("tpot", "mserve_time_per_output_token_seconds", "Per token after the first"),
                                 ("e2e", "mserve_e2e_request_latency_seconds", "Arrival to result")):
            if key in hist:
                yield _histogram(name, help_, hist[key])
        yield from self._models(status.get("models") or {})

    @staticmethod
    def _models(models: dict[str, Any]) -> Iterator[Metric]:
        """The same numbers per served model (coordinator/models.py), labelled `model`: each model has its
        own pools, queues and shedding, so its SLOs are judged on its own."""
        alive = GaugeMetricFamily("mserve_model_workers_alive", "Live workers per pool of each model",
                                  labels=["model", "role"])
        in_flight = GaugeMetricFamily("mserve_model_requests_in_flight", "Requests admitted and not ended, per model",
                                      labels=["model"])
        stats = {key: CounterMetricFamily(f"mserve_model_requests_{key}", f"{help_}, per model", labels=["model"])
                 for key, help_ in _COORDINATOR_STATS.items()}
        labelled = {kind: HistogramMetricFamily(name, help_, labels=["model", *labels])
                    for kind, (name, help_, labels) in _LABELLED.items()}
        for name, m in sorted(models.items()):
            if not isinstance(m, dict):
                continue
            for role in ("encode", "prefill", "decode", "unified"):
                alive.add_metric([name, role], (m.get("roles") or {}).get(role, 0))
            in_flight.add_metric([name], m.get("requests_in_flight", 0))
            for key, family in stats.items():
                family.add_metric([name], (m.get("stats") or {}).get(key, 0))
            for kind, snaps in ((m.get("telemetry") or {}).get("labelled") or {}).items():
                if kind in labelled:
                    for key, snap in sorted(snaps.items()):
                        values = dict(zip(_LABELLED[kind][2], key.split("|")))
                        _histogram("", "", snap, {"model": name, **values}, labelled[kind])
        yield alive
        yield in_flight
        yield from stats.values()
        yield from labelled.values()

    def _workers(self, workers: dict[str, Any], roles: dict[str, int]) -> Iterator[Metric]:
        alive = GaugeMetricFamily("mserve_workers_alive", "Live workers per pool", labels=["role"])
        for role in ("encode", "prefill", "decode", "unified"):
            alive.add_metric([role], roles.get(role, 0))
        yield alive
        labels = ["worker", "role"]
        up = GaugeMetricFamily("mserve_worker_up", "1 while the coordinator counts the worker alive", labels=labels)
        steps = HistogramMetricFamily("mserve_worker_step_seconds", "One engine step (an encoder: one batch's "
                                      "vision forward)", labels=labels)
        gauges = {k: GaugeMetricFamily(n, h, labels=labels) for k, (n, h, _) in WORKER_GAUGES.items()}
        counters = {k: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(n, h, labels=labels)
                    for k, (n, h, kind) in WORKER_COUNTERS.items()}
        for wid, w in sorted(workers.items()):
            lv = [wid, str(w.get("role", ""))]
            up.add_metric(lv, 1 if w.get("alive") else 0)
            load = WorkerLoad.read(w.get("load"))
            for key, (_, _, scale) in WORKER_GAUGES.items():
                if (value := getattr(load, key)) is not None:
                    gauges[key].add_metric(lv, value * scale)
            for key, value in (w.get("counters") or {}).items():
                if key in counters and isinstance(value, (int, float)):
                    counters[key].add_metric(lv, value)
            step = (w.get("histograms") or {}).get("step_seconds")
            if isinstance(step, dict) and step.get("count"):
                _histogram("", "", step, dict(zip(labels, lv)), steps)
        yield up
        yield steps
        yield from gauges.values()
        yield from counters.values()


class GatewayMetrics:
    """Prometheus registry of one gateway: its own HTTP view plus the cluster's (see ClusterCollector)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(namespace="mserve_gateway", registry=self.registry)
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)
        self.requests = Counter("mserve_gateway_requests", "HTTP chat completions by outcome (ok or error code)",
                                ["outcome"], registry=self.registry)
        self.running = Gauge("mserve_gateway_requests_running", "HTTP chat completions in progress",
                             registry=self.registry)
        self.ttft = Histogram("mserve_gateway_time_to_first_token_seconds", "First token as the gateway saw it",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("mserve_gateway_e2e_request_latency_seconds", "Whole request as the gateway saw it",
                             buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def started(self) -> None:
        self.running.inc()

    def ended(self, gen: Any, error: BaseException | None = None) -> None:
        """Once per started request (``gen``: the Generation), with the exception that ended it, if any."""
        self.running.dec()
        if error is None:
            outcome = "ok"
        else:
            outcome = str(getattr(error, "code", None) or ("disconnected" if error.__class__.__name__ in
                                                           ("ClientGone", "CancelledError") else "internal"))
        self.requests.labels(outcome).inc()
        if gen.t_first is not None:
            self.ttft.observe(gen.t_first - gen.t_start)
        if error is None:
            self.e2e.observe(time.perf_counter() - gen.t_start)

    def render(self, status: dict[str, Any] | None) -> tuple[bytes, str]:
        self.cluster.status = status
        try:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        finally:
            self.cluster.status = None
