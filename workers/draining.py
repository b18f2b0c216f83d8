"""A worker's drain: on SIGTERM it stops taking new work, finishes what it has, then exits.

1. SIGTERM: the worker keeps running and reports ``draining: true`` in its load (next heartbeat,
   and Redis). The coordinator routes nothing new to it from then on.
2. The coordinator sends SHUTDOWN once no request of its has a stage open on the worker or data
   parked there (coordinator/drain.py). Stage messages it sent before it heard of the drain arrive
   before the SHUTDOWN (one ordered link) and are run like any other.
3. The worker exits when it has the SHUTDOWN, its engine is idle and every tensor it published
   (embeddings, KV blocks) has been fetched: nothing in flight is lost, nothing is re-run.

Escape hatches: a second SIGTERM exits at once; so does losing the coordinator link (its requests
belonged to that coordinator); and `drain_timeout_s` bounds the whole drain (the coordinator then
re-runs what is left, as for any worker that leaves). Pure bookkeeping: the worker feeds it.
"""

from __future__ import annotations


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.active = False  # SIGTERM received: report draining, exit when released and idle
        self.released = False  # the coordinator sent SHUTDOWN: nothing of its depends on this worker
        self.link_down = False  # the last send to the coordinator found no connection
        self.deadline = 0.0
        self.announced = False  # the worker logged the start of the drain

    def begin(self, now: float) -> bool:
        """Start draining; False if it had already started (a second SIGTERM: stop now)."""
        if self.active:
            return False
        self.active, self.deadline = True, now + self.timeout_s
        return True

    def exit_reason(self, *, busy: bool, unfetched: int, now: float) -> str | None:
        """Why the draining worker should exit now, or None to keep going."""
        if not self.active:
            return None
        if self.released and not busy and unfetched == 0:
            return "drained: released by the coordinator, engine idle, every transfer fetched"
        if self.link_down:
            return "the coordinator is unreachable while draining"
        if now >= self.deadline:
            return (f"drain timeout ({self.timeout_s:g}s) with work left (busy {busy}, {unfetched} transfer(s) "
                    "unfetched): the coordinator re-runs what it still needs")
        return None
