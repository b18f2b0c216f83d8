"""Per-request benchmark records and their aggregate metrics, using vLLM `bench serve` definitions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES: tuple[float, ...] = (50, 90, 99)
CLASS_FIELDS: tuple[str, ...] = ("modality", "priority", "latency_class")
# Grouped by too, when the target says which model answered (a group of variants routes among several).
SERVED_MODEL_FIELD = "served_model"
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
# vLLM spells the end-to-end SLO "e2el"; accept both so goodput flags carry over.
_SLO_ALIASES = {"e2el": "e2e"}


@dataclass
class RequestRecord:
    """What one request did. Times are seconds on one monotonic clock (e.g. perf_counter).

    prompt_tokens counts every prompt token the model consumed, image tokens
    included (as OpenAI `usage.prompt_tokens` does); visual_tokens is the part
    of it that came from images (0 if unknown). cache_hits maps a cache name to
    (hits, lookups), e.g. {"prefix": (cached_tokens, prompt_tokens),
    "encoder": (images_hit, images)}; a bare number x means (x, 1). served_model is
    the model the server says answered (the `model` of an OpenAI response, of an
    MServe result): with a group of model variants, the variant it was routed to.
    """

    request_id: str
    modality: str = "text"
    priority: int = 0
    latency_class: str = "interactive"
    start_s: float = 0.0
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    visual_tokens: int = 0
    output_tokens: int = 0
    cache_hits: dict[str, Any] = field(default_factory=dict)
    served_model: str | None = None  # None: the target did not say
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.error_type is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); undefined for fewer than 2 output tokens."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive token/chunk arrivals."""
        return np.diff(np.asarray(self.token_times_s, dtype=float)).tolist() if len(self.token_times_s) > 1 else []


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """p50/p90/p99/mean in milliseconds (numpy linear interpolation, like vLLM); None when empty."""
    keys = [f"p{p:g}" for p in percentiles] + ["mean"]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"p{p:g}": float(v) for p, v in zip(percentiles, np.percentile(arr, list(percentiles)))}
    out["mean"] = float(arr.mean())
    return out


def _normalize_slos(slos: dict[str, float] | None) -> dict[str, float]:
    norm: dict[str, float] = {}
    for key, value in (slos or {}).items():
        key = _SLO_ALIASES.get(key, key)
        if key not in LATENCY_METRICS:
            raise ValueError(f"unknown SLO {key!r}; expected one of {LATENCY_METRICS}")
        norm[key] = float(value)
    return norm


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a successful request satisfies every SLO (value <= limit, in ms).

    As in vLLM, a request with a single output token has no TPOT and passes the
    TPOT SLO. The ITL SLO is per request: its longest gap must be within the
    limit (a stall anywhere fails it). A missing TTFT/E2E fails.
    """
    if not rec.ok:
        return False
    for key, limit_ms in slos_ms.items():
        if key == "ttft":
            value = rec.ttft_s
        elif key == "e2e":
            value = rec.e2e_s
        elif key == "tpot":
            value = rec.tpot_s if rec.output_tokens >= 2 else 0.0
        else:
            value = max(rec.itls_s, default=0.0)
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def _hits_lookups(value: Any) -> tuple[float, float]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return float(value[0]), float(value[1])
    return float(value), 1.0


def _rate(numer: float, duration_s: float) -> float | None:
    return numer / duration_s if duration_s > 0 else None


def summarize_group(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """Aggregate metrics for one set of records; rates are per second of the whole run."""
    slos_ms = _normalize_slos(slos)
    done = [r for r in records if r.ok]
    errors = Counter((r.error_type or "unknown") for r in records if not r.ok)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    e2es = [r.e2e_s for r in done if r.e2e_s is not None]
    itls = [gap for r in done for gap in r.itls_s]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)

    hits: dict[str, list[float]] = {}
    for r in done:
        for name, value in r.cache_hits.items():
            h, n = _hits_lookups(value)
            acc = hits.setdefault(name, [0.0, 0.0])
            acc[0] += h
            acc[1] += n

    out: dict[str, Any] = {
        "count": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "total_prompt_tokens": prompt,
        "total_visual_tokens": sum(r.visual_tokens for r in done),
        "total_output_tokens": output,
        "request_throughput": _rate(len(done), duration_s),
        "output_throughput": _rate(output, duration_s),
        "total_token_throughput": _rate(prompt + output, duration_s),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e", e2es)):
        out[f"{name}_ms"] = latency_stats(values, percentiles)
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in done)
        out["slos_ms"] = slos_ms
        out["good_requests"] = good
        out["goodput"] = _rate(good, duration_s)
    out["cache_hit_rate"] = {k: (h / n if n else None) for k, (h, n) in sorted(hits.items())}
    out["served_models"] = served_models(done)
    return out


def served_models(records: Iterable[RequestRecord]) -> dict[str, int]:
    """{model: requests it answered}, over the records whose target said which model answered."""
    return dict(sorted(Counter(r.served_model for r in records if r.served_model is not None).items()))


def summarize(
    records: Iterable[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    *,
    percentiles: Sequence[float] = PERCENTILES,
    class_fields: Sequence[str] = CLASS_FIELDS,
) -> dict[str, Any]:
    """Overall metrics plus the same metrics for each value of each class field (and of served_model,
    when any record has one).

    Result: {"overall": {...}, "by_class": {"modality": {"image": {...}}, "priority": {"0": {...}}, ...}}.
    Class values become strings so the dict survives a JSON round trip unchanged.
    """
    records = list(records)
    if any(r.served_model is not None for r in records) and SERVED_MODEL_FIELD not in class_fields:
        class_fields = (*class_fields, SERVED_MODEL_FIELD)
    by_class: dict[str, dict[str, Any]] = {}
    for fld in class_fields:
        groups: dict[str, list[RequestRecord]] = {}
        for r in records:
            value = getattr(r, fld)
            groups.setdefault("unknown" if value is None else str(value), []).append(r)
        by_class[fld] = {
            value: summarize_group(group, duration_s, slos, percentiles)
            for value, group in sorted(groups.items(), key=lambda kv: _class_sort_key(kv[0]))
        }
    return {"overall": summarize_group(records, duration_s, slos, percentiles), "by_class": by_class}


def _class_sort_key(value: str) -> tuple[int, float | str]:
    # Numeric classes (priority) sort numerically, others alphabetically.
    try:
        return (0, float(value))
    except ValueError:
        return (1, value)


def run_duration(records: Iterable[RequestRecord]) -> float:
    """Benchmark wall time: first start to last end (vLLM measures the same span)."""
    records = list(records)
    starts = [r.start_s for r in records]
    ends = [t for r in records for t in (r.end_s, *r.token_times_s[-1:]) if t is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


# The cluster's own stage timings a ZeroMQ target's RESULT carries, in the order a request meets them.
STAGES = ("queue_s", "encode_s", "prefill_s", "transfer_s", "decode_s", "worker_s", "total_s")


def stage_breakdown(records: Sequence[Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per modality (and "all"): mean/p50/p99 ms of each cluster stage timing (ZeroMQ targets)."""
    groups: dict[str, list[Any]] = {"all": []}
    for r in records:
        if r.ok and r.timings:
            groups["all"].append(r)
            groups.setdefault(r.modality, []).append(r)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, group in groups.items():
        if not group:
            continue
        out[name] = {}
        for stage in STAGES:
            vals = np.asarray([r.timings.get(stage, 0.0) for r in group], dtype=float) * 1e3
            out[name][stage] = {"mean": float(vals.mean()), "p50": float(np.percentile(vals, 50)),
                                "p99": float(np.percentile(vals, 99))}
    return out
