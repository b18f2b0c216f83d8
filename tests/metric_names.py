"""Every metric name the gateway's /metrics can render, and the names a PromQL expression uses: what the
docs' metrics table (tests/test_docs.py) and the Grafana dashboard (tests/gateway/test_dashboard_data.py)
are checked against, so a renamed metric fails there without a cluster.

`full_status` is a STATUS reply in which every family has something to show: the coordinator's own
Telemetry fed one request of each kind, and a worker load holding every field and counter the renderer
maps (mserve/gateway/metrics.py's tables), as a live worker's heartbeat carries them.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mserve.common.histogram import STEP_BUCKETS_S, Histogram
from mserve.coordinator.telemetry import Telemetry
from mserve.gateway.metrics import WORKER_COUNTERS, WORKER_GAUGES, GatewayMetrics

# Histogram series suffixes and the counter suffix: a name in PromQL ends in one of them, the family does not.
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def full_status() -> dict[str, Any]:
    tele = Telemetry()
    image = SimpleNamespace(is_video=False, num_tokens=16)
    tele.on_dispatch("encode", "image", 0.002)
    tele.on_encoded("image", 0.05, 0.01)
    tele.on_result({"queue_s": 0.01, "encode_s": 0.1, "prefill_s": 0.2, "transfer_s": 0.01, "decode_s": 0.5},
                   arrived=0.0, first_token_at=0.3, now=1.0, prompt_tokens=40, visual_tokens=16, output_tokens=5,
                   images=1, cache_hits={}, item_tokens=(("image", image.num_tokens),))
    step = Histogram(STEP_BUCKETS_S)
    step.observe(0.01)
    load = {key: 1 for key in WORKER_GAUGES}
    worker = {"role": "prefill", "alive": True, "load": load, "counters": {key: 1 for key in WORKER_COUNTERS},
              "histograms": {"step_seconds": step.snapshot()}}
    stats = {"admitted": 1, "completed": 1}
    snap = tele.snapshot()
    model = {"roles": {"prefill": 1}, "requests_in_flight": 0, "stats": stats, "telemetry": snap}
    return {"workers": {"prefill-0": worker}, "roles": {"prefill": 1}, "requests_in_flight": 0, "rss_mib": 100.0,
            "stats": stats, "telemetry": snap, "models": {"m": model}}


def rendered_families() -> set[str]:
    """Family names (no _total / _bucket suffix) the gateway renders from `full_status`, after a request."""
    metrics = GatewayMetrics()
    gen = SimpleNamespace(t_first=1.0, t_start=0.5)
    metrics.started()
    metrics.ended(gen)
    text, _ = metrics.render(full_status())
    return {fam.name for fam in text_string_to_metric_families(text.decode())}


def family_of(name: str, families: set[str]) -> str:
    """A series name (`x_bucket`, `x_total`) as its family's name when that family exists, else unchanged."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


_PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "le", "without", "avg", "max", "min", "count",
                 "increase", "irate", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are neither functions, keywords, nor
    label names (inside braces or a `by (...)` clause)."""
    stripped = re.sub(r"\{[^}]*\}", "", expr)
    stripped = re.sub(r"\b(by|without)\s*\([^)]*\)", "", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped))
    return {n for n in names if n not in _PROMQL_WORDS and n.startswith("mserve_")}
