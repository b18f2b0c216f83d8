"""The coordinator's worker table, one WorkerRecord per worker: role, when last heard, load, death, draining.

Pure bookkeeping, no sockets and no clock: callers pass `now`. What a death means for the requests
on a worker is the request machine's business (coordinator/requests.py); this table only records it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mserve.common.policy import DEFAULT_ENGINE
from mserve.common.protocol.to_coordinator import WorkerInfo, WorkerLoad
from mserve.coordinator.routing import WorkerView

# The figures of a worker's load that its routing view keeps (the fields WorkerLoad and WorkerView share;
# `inflight` is the coordinator's own count, never taken from a report).
VIEW_FIGURES = tuple(f.name for f in dataclasses.fields(WorkerLoad)
                     if f.name in {v.name for v in dataclasses.fields(WorkerView)} and f.name != "inflight")


@dataclass
class WorkerRecord:
    """One worker as the coordinator knows it: what routing reads (`view`) and the bookkeeping around it."""

    view: WorkerView  # role, liveness, reported load, and the stages charged to it (routing.py)
    info: WorkerInfo  # its registration (READY)
    last_seen: float
    load_at: float = 0.0  # when the load last applied was measured (the worker's clock; 0: none yet)
    queued: set[str] = field(default_factory=set)  # requests it holds but has not started
    counters: dict[str, float] = field(default_factory=dict)  # its engine counters (heartbeats)
    histograms: dict[str, Any] = field(default_factory=dict)  # its engine's histogram snapshots (step time)
    # Its load says "draining" (it got SIGTERM): routed nothing new (coordinator/drain.py); and whether
    # SHUTDOWN went out because nothing depends on it any more.
    draining: bool = False
    shutdown_sent: bool = False
    # Requests moved off it when it was declared dead: cancelled there if it turns out to be alive.
    abandoned: set[str] = field(default_factory=set)


class Membership:
    def __init__(self, block_size: int = DEFAULT_ENGINE.block_size) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self.block_size = block_size  # KV block size the workers announce: the coordinator's routing unit
        # image hash -> workers known (from their ENCODED replies) to hold its embeddings
        self.embedding_holders: dict[str, set[str]] = {}
        # worker id -> its role switch under way (coordinator/role_switching.py's Switch): routed nothing
        # new and released like a draining worker; kept across its BYE and READY
        self.switching: dict[str, Any] = {}

    def get(self, worker_id: str) -> WorkerView | None:
        rec = self._records.get(worker_id)
        return None if rec is None else rec.view

    def views(self) -> list[WorkerView]:
        return [rec.view for rec in self._records.values()]

    def is_alive(self, worker_id: str) -> bool:
        w = self.get(worker_id)
        return w is not None and w.alive

    def alive_ids(self) -> list[str]:
        return [wid for wid, rec in self._records.items() if rec.view.alive]

    def routable(self) -> list[WorkerView]:
        """The workers new work may go to: alive, not draining and not switching role."""
        return [rec.view for wid, rec in self._records.items()
                if rec.view.alive and not rec.draining and wid not in self.switching]

    def is_draining(self, worker_id: str) -> bool:
        rec = self._records.get(worker_id)
        return rec is not None and rec.draining

    def join(self, worker_id: str, info: WorkerInfo, now: float) -> set[str]:
        """Register (or re-register) a live worker; returns the requests it was abandoned with, to cancel."""
        old = self._records.get(worker_id)
        # Draining, SHUTDOWN and the load's clock start anew (a restarted process); its last queue and
        # counters stand until its next report.
        self._records[worker_id] = WorkerRecord(
            WorkerView(worker_id, info.role, host_id=info.host_id), info=info, last_seen=now,
            queued=old.queued if old else set(), counters=old.counters if old else {})
        self.block_size = info.block_size or self.block_size
        self.apply_load(worker_id, info.load)
        return old.abandoned if old else set()

    def draining_to_release(self) -> list[str]:
        """Live draining (or role-switching) workers not yet sent SHUTDOWN, by id."""
        return sorted(wid for wid, rec in self._records.items()
                      if (rec.draining or wid in self.switching) and not rec.shutdown_sent and rec.view.alive)

    def mark_shutdown_sent(self, worker_id: str) -> None:
        self._records[worker_id].shutdown_sent = True

    def holds_queued(self, worker_id: str | None, rid: str) -> bool:
        """True when a live worker's latest report lists `rid` as waiting there, not yet started."""
        rec = self._records.get(worker_id or "")
        return rec is not None and rec.view.alive and rid in rec.queued

    def seen(self, worker_id: str, now: float) -> None:
        self._records[worker_id].last_seen = now

    def apply_load(self, worker_id: str, load: WorkerLoad) -> None:
        """Take a worker's load report unless an earlier one: a heartbeat and a Redis read can arrive
        out of order, and a stale "idle" must never overwrite a fresh "busy". A field left out (None)
        leaves what the coordinator had."""
        rec = self._records.get(worker_id)
        if rec is None:
            return
        if load.at is not None:
            if load.at < rec.load_at:
                return
            rec.load_at = load.at
        if load.draining is not None:
            rec.draining = load.draining
        if load.queued is not None:
            rec.queued = set(load.queued)
        if load.counters is not None:
            rec.counters = {str(k): v for k, v in load.counters.items() if isinstance(v, (int, float))}
        if load.histograms is not None:
            rec.histograms = {str(k): v for k, v in load.histograms.items() if isinstance(v, dict)}
        for name in VIEW_FIGURES:
            if (value := getattr(load, name)) is not None:
                setattr(rec.view, name, value)

    def silent(self, now: float, dead_after_s: float) -> list[tuple[str, float]]:
        """Live workers not heard from for more than dead_after_s, with how long they have been silent."""
        return [(wid, now - rec.last_seen) for wid, rec in self._records.items()
                if rec.view.alive and now - rec.last_seen > dead_after_s]

    def mark_dead(self, worker_id: str) -> WorkerView | None:
        """Declare a live worker dead (its cached embeddings go with it); None if unknown or already dead."""
        w = self.get(worker_id)
        if w is None or not w.alive:
            return None
        w.alive = False
        for holders in self.embedding_holders.values():
            holders.discard(worker_id)
        return w

    def abandon(self, worker_id: str, rid: str) -> None:
        self._records[worker_id].abandoned.add(rid)

    def add_holder(self, image_hash: str, worker_id: str) -> None:
        self.embedding_holders.setdefault(image_hash, set()).add(worker_id)

    def charge(self, worker_id: str, tokens: int) -> None:
        w = self._records[worker_id].view
        w.inflight += 1
        w.inflight_tokens += tokens

    def uncharge(self, worker_id: str, tokens: int) -> None:
        w = self.get(worker_id)
        if w is not None:
            w.inflight = max(0, w.inflight - 1)
            w.inflight_tokens = max(0, w.inflight_tokens - tokens)

    def uncharge_tokens(self, worker_id: str, tokens: int) -> None:
        """The stage stays open on the worker, but its prompt tokens are done."""
        w = self.get(worker_id)
        if w is not None:
            w.inflight_tokens = max(0, w.inflight_tokens - tokens)

    def status(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(per-worker role/liveness/load, live workers per role) as STATUS_REPLY shows them."""
        roles: dict[str, int] = {}
        for w in self.views():
            if w.alive:
                roles[w.role] = roles.get(w.role, 0) + 1
        workers = {wid: {"role": rec.view.role, "alive": rec.view.alive, "draining": rec.draining,
                         "load": _load_shown(rec.view), "counters": rec.counters,
                         "histograms": rec.histograms,
                         **({"switching": f"{sw.from_role}->{sw.to_role} ({sw.phase})"}
                            if (sw := self.switching.get(wid)) is not None else {})}
                   for wid, rec in self._records.items()}
        return workers, roles


def _load_shown(w: WorkerView) -> dict[str, Any]:
    """A worker's load as STATUS_REPLY shows it: the figures routing reads, and the stages in flight there."""
    return WorkerLoad(**{name: getattr(w, name) for name in VIEW_FIGURES}, inflight=w.inflight).fields()
