"""The operator's view of a running cluster: the live page in a real headless Chromium, and every
expression of the Grafana dashboard evaluated by a real Prometheus scraping the gateway's /metrics.

One cluster for both: the shared tiny-LLaVA 1e1p1d cluster (tests/clusters.py), with a gateway in front
of it (started once, kept with the cluster). Each test sends its own load while it watches: the page
plots what happens after it opens, and Prometheus' rates need a series scraped before it grows.
"""

from __future__ import annotations

import base64
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mserve.common.protocol.core import LATENCY_CLASSES
from mserve.coordinator.launcher import LocalCluster
from mserve.gateway.dashboard import PANELS
from tests.browser import CHROMIUM, Browser
from tests.clusters import LLAVA_1E1P1D
from tests.gateway.test_dashboard_data import GRAFANA, grafana_exprs
from tests.helpers import make_image, wait_for
from tests.prometheus_server import PROMETHEUS, Prometheus

pytestmark = pytest.mark.slow
# Grafana's variables, as a query of the whole dashboard sees them: every model, a 1-minute rate window.
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*"}


@pytest.fixture(scope="module", params=[LLAVA_1E1P1D], ids=str)
def gateway(request, shared_clusters):
    cluster: LocalCluster = shared_clusters.get(request.param)
    if getattr(cluster, "gateway_url", None) is None:  # the cluster's one gateway, kept while it runs
        cluster.gateway_url = cluster.start_gateway()
    yield cluster.gateway_url
    shared_clusters.release(request.param)


@pytest.fixture(scope="module")
def prometheus(gateway, tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus)")
    with Prometheus(tmp_path_factory.mktemp("prometheus"), [gateway[len("http://"):]]) as prom:
        wait_for(prom.targets_up, timeout_s=60, what="Prometheus to scrape the gateway", every_s=0.25)
        yield prom


_waves = iter(range(1000))


def send_load(url: str, n: int = 8) -> None:
    """`n` chat completions with one image each, 4 at a time; every image twice (the second from a cache),
    and images no earlier call sent (the first time: encoded)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    wave = next(_waves)
    images = [make_image(48 + 8 * i, 40, seed=1000 * wave + i) for i in range(n // 2)]

    def one(i: int) -> None:
        url_ = "data:image/png;base64," + base64.b64encode(images[i % len(images)]).decode()
        body = {"model": model, "max_tokens": 6, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_}},
                                                          {"type": "text", "text": f"Describe {i}."}]}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_live_page_plots_every_panel_in_a_real_browser(gateway, tmp_path):
    with Browser(tmp_path) as browser:
        browser.navigate(gateway + "/dashboard")  # watching first, as an operator would: the load comes live
        send_load(gateway)

        def panels() -> dict | None:
            if int(browser.evaluate("document.body.dataset.samples || 0")) < 3:
                return None  # lines, not single points
            got = browser.evaluate("JSON.stringify(Object.fromEntries([...document.querySelectorAll('.panel')]"
                                   ".map(b => [b.id, Number(b.dataset.points || 0)])))")
            got = json.loads(got or "{}")
            return got if len(got) == len(PANELS) and all(n >= 2 for n in got.values()) else None

        try:
            drawn = wait_for(panels, timeout_s=60, what="every panel to plot points", every_s=0.5)
        finally:
            shot = browser.screenshot(tmp_path / "dashboard.png")
            print(f"dashboard screenshot: {shot}")
        assert set(drawn) == {f"panel-{k}" for k in PANELS}  # rate, ttft (also per class), tpot, e2e, queues...
        paths = browser.evaluate("document.querySelectorAll('#panel-ttft path[data-series]').length")
        assert paths >= 1
        assert int(browser.evaluate("document.body.dataset.polls")) >= 1
        assert not browser.errors, browser.errors
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one


def test_prometheus_evaluates_every_grafana_expression_with_data(gateway, prometheus):
    # A rate needs two samples of a series: the first wave makes every series exist in Prometheus (the
    # labelled histograms appear at their first observation), the second one increases them.
    send_load(gateway)
    wait_for(lambda: prometheus.query("mserve_model_encode_worker_seconds_count"), timeout_s=30,
             what="Prometheus to scrape the first wave", every_s=0.25)
    send_load(gateway)
    exprs = grafana_exprs(json.loads(GRAFANA.read_text()))
    assert len(exprs) >= 30

    def substituted(expr: str) -> str:
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        return expr

    def empty() -> list[str]:
        """The panels whose expression returns no finite value yet."""
        out = []
        for title, expr in exprs:
            result = prometheus.query(substituted(expr))
            if not any(math.isfinite(float(r["value"][1])) for r in result):
                out.append(f"{title}: {expr} -> {result}")
        return out

    last: list[list[str]] = [[]]

    def all_have_data() -> bool:
        last[0] = empty()
        return not last[0]

    try:
        wait_for(all_have_data, timeout_s=30, what="every dashboard expression to return data", every_s=1.0)
    except AssertionError:
        raise AssertionError("expressions without data:\n" + "\n".join(last[0])) from None
    # The new families carry what the cluster did: image requests queued at each of its three stages, and
    # each role's workers timed their steps (an encoder: its vision batches).
    waits = {r["metric"]["stage"] for r in prometheus.query(
        'mserve_model_stage_queue_wait_seconds_count{modality="image"} > 0')}
    assert waits == {"encode", "prefill", "decode"}
    assert prometheus.query('mserve_model_encode_preprocess_seconds_count{modality="image"} > 0')  # decoding
    stages = {r["metric"]["stage"] for r in prometheus.query(
        'mserve_model_request_stage_seconds_count{modality="image"} > 0')}
    assert {"encode", "transfer"} <= stages  # encode and embedding transfer per modality
    roles = {r["metric"]["role"] for r in prometheus.query("mserve_worker_step_seconds_count > 0")}
    assert roles == {"encode", "prefill", "decode"}
    classes = {r["metric"]["class"] for r in prometheus.query("mserve_model_time_to_first_token_seconds_count > 0")}
    # this test's requests' default latency class (the shared cluster's other users may have sent "batch" too)
    assert "interactive" in classes and classes <= set(LATENCY_CLASSES)
