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

from mserve.coordinator.records import STAGE_ROLE, RequestState, Stage


def holds_work(requests: Iterable[RequestState], worker_id: str) -> bool:
    """True while a request has a stage open on the worker, or data (embeddings, KV) parked there
    that its next stage will fetch (RequestState.needs)."""
    return any(st.needs(worker_id) for st in requests)


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
        elif st.next_stage in STAGE_ROLE:
            add(STAGE_ROLE[st.next_stage], st)
    return out
