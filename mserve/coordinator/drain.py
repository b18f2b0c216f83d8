"""Draining workers and parked requests, as the request machine sees them. Pure: no sockets, no clock.

A worker that got SIGTERM reports ``draining`` in its load (heartbeats and Redis). From then on the
coordinator routes nothing new to it (`Membership.routable`), and once nothing of the coordinator's
depends on it (`holds_work` is false) sends it SHUTDOWN; the worker then exits as soon as its engine
is idle and every tensor it published has been fetched. See docs/autoscaling.md, "Draining".

`waiting_by_role` is what `mserve autoscale` reads to start a pool from zero: the requests parked
because no worker of a role can take them (an image request with no encode worker), per role.
"""

from __future__ import annotations

from typing import Any, Iterable

from mserve.coordinator.records import ACTIVE_STAGES, RequestState, Stage

_STAGE_ROLE = {Stage.ENCODE: "encode", Stage.PREFILL: "prefill", Stage.DECODE: "decode", Stage.RUN: "unified"}


def holds_work(requests: Iterable[RequestState], worker_id: str) -> bool:
    """True while a request has a stage open on the worker, or is parked with data (embeddings, KV)
    that lives there and will be fetched from it."""
    for st in requests:
        if st.worker_id == worker_id and st.stage in ACTIVE_STAGES:
            return True
        if st.stage == Stage.QUEUED:
            if st.embeddings is not None and st.embeddings_from == worker_id and st.next_stage == Stage.PREFILL:
                return True
            if st.kv is not None and st.kv_from == worker_id and st.next_stage == Stage.DECODE:
                return True
    return False


def waiting_by_role(requests: Iterable[RequestState], routable_roles: set[str], now: float) -> dict[str, Any]:
    """{role: {"requests": n, "oldest_s": age}} for the requests parked for want of a worker of that role.

    A request parked before its pipeline was chosen counts for every role it needs and lacks
    (prefill and decode, encode too when it has images)."""
    out: dict[str, dict[str, Any]] = {}

    def add(role: str, st: RequestState) -> None:
        entry = out.setdefault(role, {"requests": 0, "oldest_s": 0.0})
        entry["requests"] += 1
        entry["oldest_s"] = round(max(entry["oldest_s"], now - st.arrived), 3)

    for st in requests:
        if st.stage != Stage.QUEUED:
            continue
        if st.next_stage == Stage.START:
            needed = {"prefill", "decode"} | ({"encode"} if st.has_images else set())
            for role in sorted(needed - routable_roles):
                add(role, st)
        elif st.next_stage in _STAGE_ROLE:
            add(_STAGE_ROLE[st.next_stage], st)
    return out
