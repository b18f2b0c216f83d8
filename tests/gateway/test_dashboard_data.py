"""The operator's view without a cluster: the live page's numbers (mserve/gateway/dashboard.py) from
STATUS replies, and the Grafana dashboard's metric names against what /metrics renders."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from mserve.common.histogram import LATENCY_BUCKETS_S, Histogram
from mserve.gateway.dashboard import PANELS, Dashboard, page, quantile
from tests.metric_names import family_of, full_status, promql_metrics, rendered_families

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mserve.json"


def grafana_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query in the dashboard."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_quantile_interpolates_within_a_bucket_as_prometheus_does():
    le = [0.1, 0.2, 0.4]
    assert quantile(0.5, le, [0, 4, 0, 0]) == pytest.approx(0.15)  # all in (0.1, 0.2]: the middle
    assert quantile(0.25, le, [2, 2, 0, 0]) == pytest.approx(0.05)  # first bucket starts at 0
    assert quantile(0.99, le, [0, 0, 0, 3]) == 0.4  # in +Inf: the largest finite bound
    assert quantile(0.5, le, [0, 0, 0, 0]) is None


def _status_after(n_done: int, ttft_s: float, used_blocks: int) -> dict:
    status = full_status()
    model = status["models"]["m"]
    h = Histogram(LATENCY_BUCKETS_S)
    for _ in range(n_done):
        h.observe(ttft_s)
    model["telemetry"] = copy.deepcopy(model["telemetry"])
    model["telemetry"]["histograms"]["ttft"] = h.snapshot()
    model["telemetry"]["labelled"]["ttft"] = {"interactive": h.snapshot()}  # every one of them interactive
    model["stats"] = {"completed": n_done}
    status["queued"] = {"encode": {"interactive": n_done, "batch": 1}}  # coordinator/stage_queues.py's counts()
    worker = status["workers"]["prefill-0"]
    worker["load"].update(total_blocks=100, free_blocks=100 - used_blocks)
    worker["counters"].update(prefix_hits=n_done, prefix_queries=2 * n_done, encoded_images=n_done,
                              embedding_l1_hits=n_done, embedding_l2_hits=0)
    return status


def test_points_are_rates_and_percentiles_over_the_window():
    statuses = iter([_status_after(0, 0.0, 0), _status_after(10, 0.3, 25)])
    clock = iter([1000.0, 1010.0])

    async def read():
        return next(statuses)

    dash = Dashboard(read, clock=lambda: next(clock))
    asyncio.run(dash.data())
    data = asyncio.run(dash.data())
    assert data["t"] == [1000.0, 1010.0]
    panels = {p["key"]: p for p in data["panels"]}
    assert set(panels) == set(PANELS)
    assert panels["rate"]["series"]["m"][-1] == pytest.approx(1.0)  # 10 completed in 10 s
    assert 0.2 < panels["ttft"]["series"]["m p50"][-1] <= 0.3  # the 10 new observations, in (0.2, 0.3]
    assert panels["ttft"]["series"]["m p50"][0] is None  # none before
    assert 0.2 < panels["ttft_class"]["series"]["m interactive"][-1] <= 0.3  # ... and per latency class
    assert panels["kv"]["series"]["prefill-0"][-1] == 0.25
    assert panels["queued"]["series"]["encode"] == [1, 11] and panels["queued"]["series"]["decode"] == [0, 0]
    assert panels["cache"]["series"]["prefix blocks"][-1] == 0.5
    assert panels["cache"]["series"]["embedding L1"][-1] == 0.5  # 10 L1 hits, 10 encoded
    # One step before the first sample, none after: a value at first, then none in the window.
    assert panels["step"]["series"]["prefill"][0] is not None and panels["step"]["series"]["prefill"][-1] is None


def test_a_poll_within_the_sampling_period_reads_no_status():
    reads = []

    async def read():
        reads.append(1)
        return full_status()

    now = [0.0]
    dash = Dashboard(read, clock=lambda: now[0])
    asyncio.run(dash.data())
    now[0] = 1.0
    asyncio.run(dash.data())
    assert len(reads) == 1
    now[0] = 2.5
    assert len(asyncio.run(dash.data())["t"]) == 2


def test_the_page_is_self_contained():
    html = page()
    assert "dashboard/data" in html and "<script>" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "src=" not in html  # no external script or image


def test_every_grafana_expression_names_metrics_that_metrics_renders():
    rendered = rendered_families()
    dashboard = json.loads(GRAFANA.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency by model and class", "Stages", "Caches", "Workers"]
    missing = {(title, name) for title, expr in grafana_exprs(dashboard) for name in promql_metrics(expr)
               if family_of(name, rendered) not in rendered}
    assert not missing, f"dashboard panels use metrics /metrics does not render: {sorted(missing)}"


def test_a_renamed_metric_fails_the_name_check():
    """The check above can fail: rename one metric a panel uses and it is reported."""
    rendered = rendered_families()
    dashboard = json.loads(GRAFANA.read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "Time to first token")
    target = panel["targets"][0]
    target["expr"] = target["expr"].replace("mserve_model_time_to_first_token_seconds", "mserve_model_ttft_seconds")
    missing = {name for _, expr in grafana_exprs(dashboard) for name in promql_metrics(expr)
               if family_of(name, rendered) not in rendered}
    assert missing == {"mserve_model_ttft_seconds_bucket"}
