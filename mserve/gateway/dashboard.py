"""The gateway's live page: ``GET /dashboard`` (one self-contained HTML file) and ``GET /dashboard/data``.

No Grafana, no CDN, no build step: the page (dashboard.html, package data) polls /dashboard/data every
few seconds and draws each panel as SVG. The data are the numbers /metrics renders, from the same
coordinator STATUS: at most one STATUS read per ``SAMPLE_EVERY_S`` (taken when someone polls, so an
unwatched gateway pays nothing), kept for ``HISTORY_S``. Each point's percentiles and rates are over
the last ``WINDOW_S`` (bucket differences between two samples, interpolated as Prometheus'
``histogram_quantile`` does), so a point is what a Grafana panel of ``rate(...[30s])`` would show.
"""

from __future__ import annotations

import time
from collections import deque
from importlib import resources
from typing import Any, Awaitable, Callable

from mserve.common.protocol.to_coordinator import WorkerLoad

__all__ = ["Dashboard", "PANELS", "page", "quantile"]

SAMPLE_EVERY_S = 2.0
WINDOW_S = 30.0
HISTORY_S = 600.0
STAGES = ("encode", "prefill", "decode", "run")
ROLE_STAGE = {"encode": "encode", "prefill": "prefill", "decode": "decode", "unified": "run"}
# panel key -> (title, unit); every point holds {series name: value or None} for each
PANELS = {
    "rate": ("Completed requests per model", "req/s"),
    "ttft": ("Time to first token (p50 / p95 / p99)", "s"),
    "ttft_class": ("Time to first token per latency class (p95)", "s"),
    "tpot": ("Time per output token (p50 / p95 / p99)", "s"),
    "e2e": ("End-to-end latency (p50 / p95 / p99)", "s"),
    "in_flight": ("Requests in flight per model", "requests"),
    "queued": ("Coordinator queue depth per stage", "requests"),
    "queue_wait": ("Stage queue wait (p95)", "s"),
    "step": ("Worker step time per stage (p50)", "s"),
    "cache": ("Cache hit rates", "ratio"),
    "kv": ("KV pool use per worker", "ratio"),
}


def page() -> str:
    return resources.files("mserve.gateway").joinpath("dashboard.html").read_text(encoding="utf-8")


def _add(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return {"le": list(b["le"]), "counts": list(b["counts"]), "sum": b["sum"], "count": b["count"]}
    return {"le": a["le"], "counts": [x + y for x, y in zip(a["counts"], b["counts"])], "sum": a["sum"] + b["sum"],
            "count": a["count"] + b["count"]}


def _minus(cur: dict[str, Any] | None, ref: dict[str, Any] | None) -> list[int]:
    if cur is None:
        return []
    if ref is None or ref["le"] != cur["le"] or ref["count"] > cur["count"]:  # none before, or a restart
        return list(cur["counts"])
    return [a - b for a, b in zip(cur["counts"], ref["counts"])]


def quantile(q: float, le: list[float], counts: list[int]) -> float | None:
    """The q-quantile of per-bucket counts (the last bucket: +Inf), linear within a bucket as Prometheus'
    histogram_quantile; None with no observations; the largest finite bound when it falls in +Inf."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(le):
                return float(le[-1])
            lower = le[i - 1] if i else 0.0
            return lower + (le[i] - lower) * (rank - seen) / n
        seen += n
    return float(le[-1])


def extract(status: dict[str, Any]) -> dict[str, Any]:
    """The cumulative numbers one sample keeps from a STATUS reply."""
    models = {}
    for name, m in sorted((status.get("models") or {}).items()):
        tele = m.get("telemetry") or {}
        hist = tele.get("histograms") or {}
        waits: dict[str, Any] = {}
        for key, snap in ((tele.get("labelled") or {}).get("queue_wait") or {}).items():
            stage = key.split("|")[0]
            waits[stage] = _add(waits.get(stage), snap)
        classes = dict((tele.get("labelled") or {}).get("ttft") or {})  # latency class -> its TTFT histogram
        models[name] = {"hist": {k: hist[k] for k in ("ttft", "tpot", "e2e") if k in hist}, "waits": waits,
                        "ttft_class": classes,
                        "completed": (m.get("stats") or {}).get("completed", 0),
                        "in_flight": m.get("requests_in_flight", 0)}
    steps: dict[str, Any] = {}
    kv: dict[str, float | None] = {}
    cache = {k: 0.0 for k in ("embedding_l1_hits", "embedding_l2_hits", "encoded_images", "prefix_hits",
                              "prefix_queries")}
    for wid, w in sorted((status.get("workers") or {}).items()):
        if not w.get("alive"):
            continue
        load, counters = WorkerLoad.read(w.get("load")), w.get("counters") or {}
        stage = ROLE_STAGE.get(str(w.get("role")))
        step = (w.get("histograms") or {}).get("step_seconds")
        if stage and isinstance(step, dict):
            steps[stage] = _add(steps.get(stage), step)
        total = load.total_blocks or 0
        if w.get("role") != "encode" and total:
            kv[wid] = (total - (load.free_blocks or 0)) / total
        for key in cache:
            cache[key] += counters.get(key, 0) or 0
    queued = {stage: sum((status.get("queued") or {}).get(stage, {}).values()) for stage in STAGES}
    return {"models": models, "steps": steps, "kv": kv, "cache": cache, "queued": queued}


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def _percentiles(cur: dict[str, Any] | None, ref: dict[str, Any] | None, prefix: str,
                 qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> dict[str, float | None]:
    counts = _minus(cur, ref)
    out = {}
    for q in qs:
        v = quantile(q, cur["le"], counts) if cur is not None else None
        out[f"{prefix}p{round(q * 100)}"] = None if v is None else round(v, 6)
    return out


def point(t: float, cur: dict[str, Any], ref: dict[str, Any] | None, dt: float) -> dict[str, dict[str, Any]]:
    """One point of every panel: ``cur`` against ``ref`` (``dt`` seconds before; None: since the start)."""
    p: dict[str, dict[str, Any]] = {k: {} for k in PANELS}
    for name, m in cur["models"].items():
        old = (ref or {}).get("models", {}).get(name)
        p["rate"][name] = round((m["completed"] - (old["completed"] if old else 0)) / dt, 4) if dt > 0 else None
        p["in_flight"][name] = m["in_flight"]
        for key in ("ttft", "tpot", "e2e"):
            p[key].update(_percentiles(m["hist"].get(key), old["hist"].get(key) if old else None, f"{name} "))
        for cls, h in m.get("ttft_class", {}).items():
            old_h = old.get("ttft_class", {}).get(cls) if old else None
            p["ttft_class"][f"{name} {cls}"] = _percentiles(h, old_h, "", (0.95,))["p95"]
        for stage, h in m["waits"].items():
            w = _percentiles(h, old["waits"].get(stage) if old else None, "", (0.95,))["p95"]
            p["queue_wait"][f"{name} {stage}"] = w
    p["queued"] = dict(cur["queued"])
    for stage, h in cur["steps"].items():
        p["step"][stage] = _percentiles(h, (ref or {}).get("steps", {}).get(stage), "", (0.5,))["p50"]
    p["kv"] = {wid: round(v, 4) for wid, v in cur["kv"].items()}
    c, o = cur["cache"], (ref or {}).get("cache") or {k: 0.0 for k in cur["cache"]}
    d = {k: c[k] - o.get(k, 0.0) for k in c}
    looked_up = d["embedding_l1_hits"] + d["embedding_l2_hits"] + d["encoded_images"]
    p["cache"] = {"embedding L1": _ratio(d["embedding_l1_hits"], looked_up),
                  "embedding L2": _ratio(d["embedding_l2_hits"], looked_up),
                  "prefix blocks": _ratio(d["prefix_hits"], d["prefix_queries"])}
    return p


class Dashboard:
    """The ring buffer behind /dashboard/data."""

    def __init__(self, read_status: Callable[[], Awaitable[dict[str, Any]]],
                 clock: Callable[[], float] = time.time) -> None:
        self.read_status, self.clock = read_status, clock
        self.samples: deque[tuple[float, dict[str, Any]]] = deque()  # (t, extract()) for the window
        self.points: deque[tuple[float, dict[str, Any]]] = deque()  # (t, point()) for the history

    def add(self, t: float, status: dict[str, Any]) -> None:
        cur = extract(status)
        while self.samples and self.samples[0][0] < t - WINDOW_S:
            self.samples.popleft()
        ref_t, ref = self.samples[0] if self.samples else (t - WINDOW_S, None)
        self.samples.append((t, cur))
        self.points.append((t, point(t, cur, ref, t - ref_t)))
        while self.points and self.points[0][0] < t - HISTORY_S:
            self.points.popleft()

    async def data(self) -> dict[str, Any]:
        now = self.clock()
        if not self.points or now - self.points[-1][0] >= SAMPLE_EVERY_S:
            self.add(now, await self.read_status())
        return self.render()

    def render(self) -> dict[str, Any]:
        """{"t": [...], "panels": [{key, title, unit, series: {name: [value or None per t]}}]}."""
        ts = [t for t, _ in self.points]
        panels = []
        for key, (title, unit) in PANELS.items():
            names = sorted({n for _, p in self.points for n in p[key]})
            panels.append({"key": key, "title": title, "unit": unit,
                           "series": {n: [p[key].get(n) for _, p in self.points] for n in names}})
        return {"t": [round(t, 3) for t in ts], "window_s": WINDOW_S, "sample_every_s": SAMPLE_EVERY_S,
                "panels": panels}
