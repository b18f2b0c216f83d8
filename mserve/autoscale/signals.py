"""What the autoscaler observes, turned into a policy `Observation`.

Two sources, read each tick, either of which may be down:

* the coordinator's STATUS (what `mserve status --json` shows): every worker's role, liveness,
  ``draining`` flag and load (queue, running, KV blocks, and ``inflight``: stages it handed the worker
  and has not seen finish), ``waiting`` (requests parked for want of a worker of a role), and its
  telemetry: cumulative histograms of each stage's time, TTFT, TPOT and end-to-end time, and counters
  (images among them). Differences between two ticks give the SLO attainment, stage p90s and whether
  images arrived *since the last tick*.
* Redis, when the coordinator does not answer: the worker registry and each worker's published load
  (queue, running, KV blocks, draining). No SLO, parked requests or in-flight counts then.

With several models in one cluster (coordinator/models.py), `model_view` narrows both sources to one
model's workers, telemetry and parked requests: one autoscaler per model (`--model-name`).

`Signals.observe` is pure (tests feed it hand-made dicts); `Reader` does the reading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from mserve.autoscale import POOLS
from mserve.autoscale.policy import SLO, Observation, PoolObservation
from mserve.common.protocol.to_coordinator import WorkerLoad

log = logging.getLogger("mserve.autoscale")

STAGE_HISTOGRAM = {"encode": "encode", "prefill": "prefill", "decode": "tpot"}


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def histogram_delta(cur: dict[str, Any] | None, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The observations `cur` holds that `prev` (an earlier snapshot of the same histogram) did not.
    A coordinator that restarted (counts went down) counts from zero again."""
    if not isinstance(cur, dict) or not isinstance(cur.get("counts"), list):
        return None
    counts = [int(c) for c in cur["counts"]]
    if isinstance(prev, dict) and isinstance(prev.get("counts"), list) and len(prev["counts"]) == len(counts):
        diff = [c - int(p) for c, p in zip(counts, prev["counts"])]
        if all(d >= 0 for d in diff):
            counts = diff
    return {"le": list(cur.get("le") or []), "counts": counts, "count": sum(counts)}


def fraction_within(h: dict[str, Any] | None, limit: float) -> float | None:
    """Share of a (delta) histogram's observations in buckets whose upper bound is <= limit (conservative:
    a bucket straddling the limit counts as missed). None when it holds none."""
    if not h or not h["count"]:
        return None
    ok = sum(c for le, c in zip(h["le"], h["counts"]) if le <= limit + 1e-12)
    return ok / h["count"]


def quantile(h: dict[str, Any] | None, q: float) -> float | None:
    """Upper bound of the bucket holding the q-quantile (the last finite bound for the +Inf bucket)."""
    if not h or not h["count"]:
        return None
    need, seen = q * h["count"], 0
    for i, c in enumerate(h["counts"]):
        seen += c
        if seen >= need and c:
            return float(h["le"][min(i, len(h["le"]) - 1)])
    return float(h["le"][-1]) if h["le"] else None


def model_view(status: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The STATUS of one model of a coordinator serving several: its workers, telemetry and parked requests.
    `model` None (the whole cluster) or a coordinator without per-model status: `status` as it is."""
    per_model = status.get("models")
    if model is None or not isinstance(per_model, dict):
        return status
    own = per_model.get(model) if isinstance(per_model.get(model), dict) else {}
    workers = status.get("workers") if isinstance(status.get("workers"), dict) else {}
    return {**own, "workers": {wid: w for wid, w in workers.items() if isinstance(w, dict) and w.get("model") == model}}


def model_registry(registry: dict[str, Any], model: str | None) -> dict[str, Any]:
    """Redis's worker registry narrowed to one model's workers (each registered with its READY's `model`)."""
    if model is None:
        return registry
    return {wid: info for wid, info in registry.items() if isinstance(info, dict) and info.get("model") == model}


@dataclass
class Snapshot:
    """One tick's observation, plus which workers it saw (the local backend tells its own from the rest)."""
    observation: Observation
    ready_ids: dict[str, list[str]] = field(default_factory=dict)
    draining_ids: dict[str, list[str]] = field(default_factory=dict)
    source: str = "none"  # "coordinator", "redis" or "none"
    note: str = ""


class Signals:
    """Keeps the previous telemetry snapshot, so each observation covers the time since the last one."""

    def __init__(self, slo: SLO) -> None:
        self.slo = slo
        self._prev: dict[str, Any] | None = None

    def observe(self, now: float, status: dict[str, Any] | None, redis_workers: dict[str, Any] | None = None,
                redis_loads: dict[str, Any] | None = None) -> Snapshot:
        if isinstance(status, dict) and isinstance(status.get("workers"), dict):
            return self._from_status(now, status)
        if redis_workers is not None:
            return self._from_redis(now, redis_workers, redis_loads or {})
        return Snapshot(Observation(now=now, pools={p: PoolObservation(ready=0) for p in POOLS}), source="none",
                        note="neither the coordinator nor Redis answered")

    def _pools(self, workers: dict[str, tuple[str, bool, WorkerLoad, float | None]],
               waiting: dict[str, Any], stage_p90: dict[str, float | None]) -> tuple[dict, dict, dict]:
        """workers: id -> (role, draining, load, inflight)."""
        pools, ready_ids, draining_ids = {}, {}, {}
        for pool in POOLS:
            ready = [(wid, load, inflight) for wid, (role, dr, load, inflight) in sorted(workers.items())
                     if role == pool and not dr]
            draining_ids[pool] = sorted(wid for wid, (role, dr, _, _) in workers.items() if role == pool and dr)
            ready_ids[pool] = [wid for wid, _, _ in ready]
            work = 0.0
            used = total = 0.0
            for _, load, inflight in ready:
                reported = _num(load.queue_len) + _num(load.running)
                work += max(reported, inflight or 0.0)
                t = _num(load.total_blocks)
                if t > 0:
                    total += t
                    used += t - _num(load.free_blocks)
            w = waiting.get(pool) if isinstance(waiting.get(pool), dict) else {}
            pools[pool] = PoolObservation(
                ready=len(ready), draining=len(draining_ids[pool]), load=work,
                waiting=int(_num(w.get("requests"))), oldest_wait_s=_num(w.get("oldest_s")),
                kv_used=(used / total) if pool == "decode" and total > 0 else None,
                stage_p90_s=stage_p90.get(pool))
        return pools, ready_ids, draining_ids

    def _from_status(self, now: float, status: dict[str, Any]) -> Snapshot:
        workers = {}
        for wid, w in status["workers"].items():
            if not isinstance(w, dict) or not w.get("alive"):
                continue
            load = WorkerLoad.read(w.get("load"))
            workers[str(wid)] = (str(w.get("role")), bool(w.get("draining")), load,
                                 None if load.inflight is None else float(load.inflight))
        tel = status.get("telemetry") if isinstance(status.get("telemetry"), dict) else {}
        hists = tel.get("histograms") if isinstance(tel.get("histograms"), dict) else {}
        counters = tel.get("counters") if isinstance(tel.get("counters"), dict) else {}
        prev, self._prev = self._prev, {"histograms": hists, "images": _num(counters.get("images"))}
        ttft = tpot = None
        finished, images_seen, stage_p90 = 0, False, {}
        if prev is not None:  # the first tick has nothing to compare with: no SLO judgement yet
            delta = {name: histogram_delta(hists.get(name), prev["histograms"].get(name)) for name in hists}
            e2e = delta.get("e2e")
            finished = e2e["count"] if e2e else 0
            if self.slo.ttft_s is not None:
                ttft = fraction_within(delta.get("ttft"), self.slo.ttft_s)
            if self.slo.tpot_s is not None:
                tpot = fraction_within(delta.get("tpot"), self.slo.tpot_s)
            stage_p90 = {pool: quantile(delta.get(name), 0.9) for pool, name in STAGE_HISTOGRAM.items()}
            images_seen = _num(counters.get("images")) > prev["images"]
        waiting = status.get("waiting") if isinstance(status.get("waiting"), dict) else {}
        pools, ready_ids, draining_ids = self._pools(workers, waiting, stage_p90)
        obs = Observation(now=now, pools=pools, ttft_attainment=ttft, tpot_attainment=tpot, finished=finished,
                          images_seen=images_seen)
        return Snapshot(obs, ready_ids, draining_ids, source="coordinator")

    def _from_redis(self, now: float, registry: dict[str, Any], loads: dict[str, Any]) -> Snapshot:
        workers = {}
        for wid, info in registry.items():
            load = WorkerLoad.read(loads.get(wid))
            workers[str(wid)] = (str((info or {}).get("role")), bool(load.draining), load, None)
        pools, ready_ids, draining_ids = self._pools(workers, {}, {})
        return Snapshot(Observation(now=now, pools=pools), ready_ids, draining_ids, source="redis",
                        note="coordinator unreachable: Redis loads only (no SLO, parked or in-flight counts)")


class Reader:
    """Reads the coordinator's STATUS (client address) and Redis each tick; keeps its connections."""

    def __init__(self, coordinator: str | None, redis_url: str | None, *, timeout_s: float = 2.0,
                 api_key: str | None = None, model: str | None = None) -> None:
        self.coordinator, self.timeout_s, self.api_key = coordinator, timeout_s, api_key
        self.model = model  # observe only this served model's pools (None: the whole cluster)
        self._client: Any = None
        self._store: Any = None
        if redis_url:
            from mserve.common.redis_store import RedisStore

            self._store = RedisStore(redis_url, socket_timeout_s=timeout_s)
        self.last_error: str | None = None

    def status(self) -> dict[str, Any] | None:
        if not self.coordinator:
            return None
        from mserve.coordinator.client import Client, MServeError

        try:
            if self._client is None:
                self._client = Client(self.coordinator, timeout_s=self.timeout_s, api_key=self.api_key)
            reply = self._client.status(timeout_s=self.timeout_s)
            self.last_error = None
            return model_view(reply, self.model) if isinstance(reply, dict) else None
        except MServeError as exc:
            self.last_error = f"coordinator {self.coordinator}: {exc}"
        except Exception as exc:  # a malformed address, a socket error
            self.last_error = f"coordinator {self.coordinator}: {exc.__class__.__name__}: {exc}"
        if self._client is not None:  # a fresh socket next time: no late reply gets mixed in
            self._client.close()
            self._client = None
        return None

    def redis(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        if self._store is None or not self._store.ping():
            return None, None
        workers = model_registry(self._store.list_workers(), self.model)
        return workers, self._store.get_loads(sorted(workers))

    def read(self, signals: Signals, now: float) -> Snapshot:
        status = self.status()
        workers, loads = (None, None) if status is not None else self.redis()
        snap = signals.observe(now, status, workers, loads)
        if self.last_error and snap.source != "coordinator":
            snap.note = f"{snap.note} ({self.last_error})"
        return snap

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._store is not None:
            self._store.close()
