"""The coordinator's worker table: who joined in which role, when each was last heard, its load, who died.

Pure bookkeeping, no sockets and no clock: callers pass `now`. What a death means for the requests
on a worker is the request machine's business (coordinator/requests.py); this table only records it.
"""

from __future__ import annotations

from typing import Any, ValuesView

from mserve.coordinator.routing import WorkerView

LOAD_INTS = ("queue_len", "running", "free_blocks", "total_blocks")


class Membership:
    def __init__(self, block_size: int = 16) -> None:
        self.workers: dict[str, WorkerView] = {}
        self.info: dict[str, dict[str, Any]] = {}  # each worker's registration (READY body)
        self.last_seen: dict[str, float] = {}
        self.load_at: dict[str, float] = {}  # when the load last applied was measured (the worker's clock)
        self.queued: dict[str, set[str]] = {}  # requests each worker holds but has not started
        self.counters: dict[str, dict[str, float]] = {}  # each worker's engine counters (heartbeats)
        self.block_size = block_size  # KV block size the workers announce: the coordinator's routing unit
        # image hash -> workers known (from their ENCODED replies) to hold its embeddings
        self.embedding_holders: dict[str, set[str]] = {}
        # Requests moved off a worker declared dead: cancelled there if it turns out to be alive.
        self.abandoned: dict[str, set[str]] = {}
        # Workers whose load says "draining" (they got SIGTERM): routed nothing new (coordinator/drain.py),
        # and the ones already sent SHUTDOWN because nothing depends on them any more.
        self.draining: set[str] = set()
        self.shutdown_sent: set[str] = set()

    def get(self, worker_id: str) -> WorkerView | None:
        return self.workers.get(worker_id)

    def views(self) -> ValuesView[WorkerView]:
        return self.workers.values()

    def is_alive(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.alive

    def alive_ids(self) -> list[str]:
        return [wid for wid, w in self.workers.items() if w.alive]

    def routable(self) -> list[WorkerView]:
        """The workers new work may go to: alive and not draining."""
        return [w for wid, w in self.workers.items() if w.alive and wid not in self.draining]

    def join(self, worker_id: str, role: str, payload: dict[str, Any], now: float) -> set[str]:
        """Register (or re-register) a live worker; returns the requests it was abandoned with, to cancel."""
        self.workers[worker_id] = WorkerView(worker_id, role, host_id=str(payload.get("host_id") or ""))
        abandoned = self.abandoned.pop(worker_id, set())
        self.draining.discard(worker_id)  # until its load says so again
        self.shutdown_sent.discard(worker_id)
        self.info[worker_id] = dict(payload)
        self.last_seen[worker_id] = now
        self.load_at.pop(worker_id, None)  # a restarted process: its clock starts anew
        self.block_size = int(payload.get("block_size") or self.block_size)
        self.apply_load(worker_id, payload.get("load") or {})
        return abandoned

    def holds_queued(self, worker_id: str | None, rid: str) -> bool:
        """True when a live worker's latest report lists `rid` as waiting there, not yet started."""
        return self.is_alive(worker_id or "") and rid in self.queued.get(worker_id or "", ())

    def seen(self, worker_id: str, now: float) -> None:
        self.last_seen[worker_id] = now

    def apply_load(self, worker_id: str, load: dict[str, Any]) -> None:
        """Take a worker's load report unless an earlier one: a heartbeat and a Redis read can arrive
        out of order, and a stale "idle" must never overwrite a fresh "busy"."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        at = load.get("at")
        if isinstance(at, (int, float)):
            if at < self.load_at.get(worker_id, 0.0):
                return
            self.load_at[worker_id] = float(at)
        if "draining" in load:
            (self.draining.add if load["draining"] else self.draining.discard)(worker_id)
        if isinstance(load.get("queued"), list):
            self.queued[worker_id] = {str(r) for r in load["queued"]}
        if isinstance(load.get("counters"), dict):
            self.counters[worker_id] = {str(k): v for k, v in load["counters"].items() if isinstance(v, (int, float))}
        for key in LOAD_INTS:
            if key in load:
                setattr(w, key, int(load[key]))
        for key in ("tokens_per_s", "rss_mib", "weights_mib", "kv_pool_mib", "encode_s_per_image"):
            if isinstance(load.get(key), (int, float)):
                setattr(w, key, float(load[key]))

    def silent(self, now: float, dead_after_s: float) -> list[tuple[str, float]]:
        """Live workers not heard from for more than dead_after_s, with how long they have been silent."""
        return [(wid, now - seen) for wid, seen in self.last_seen.items()
                if self.workers[wid].alive and now - seen > dead_after_s]

    def mark_dead(self, worker_id: str) -> WorkerView | None:
        """Declare a live worker dead (its cached embeddings go with it); None if unknown or already dead."""
        w = self.workers.get(worker_id)
        if w is None or not w.alive:
            return None
        w.alive = False
        for holders in self.embedding_holders.values():
            holders.discard(worker_id)
        return w

    def abandon(self, worker_id: str, rid: str) -> None:
        self.abandoned.setdefault(worker_id, set()).add(rid)

    def add_holder(self, image_hash: str, worker_id: str) -> None:
        self.embedding_holders.setdefault(image_hash, set()).add(worker_id)

    def charge(self, worker_id: str, tokens: int) -> None:
        w = self.workers[worker_id]
        w.inflight += 1
        w.inflight_tokens += tokens

    def uncharge(self, worker_id: str, tokens: int) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.inflight = max(0, w.inflight - 1)
            w.inflight_tokens = max(0, w.inflight_tokens - tokens)

    def status(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(per-worker role/liveness/load, live workers per role) as STATUS_REPLY shows them."""
        roles: dict[str, int] = {}
        for w in self.workers.values():
            if w.alive:
                roles[w.role] = roles.get(w.role, 0) + 1
        workers = {wid: {"role": w.role, "alive": w.alive, "draining": wid in self.draining, "load": {
            "queue_len": w.queue_len, "running": w.running, "free_blocks": w.free_blocks,
            "total_blocks": w.total_blocks, "tokens_per_s": w.tokens_per_s, "inflight": w.inflight,
            "rss_mib": w.rss_mib, "weights_mib": w.weights_mib, "kv_pool_mib": w.kv_pool_mib},
            "counters": self.counters.get(wid, {})}
            for wid, w in self.workers.items()}
        return workers, roles
