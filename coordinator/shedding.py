"""Load shedding at the edge: a bounded wait for the first token, and who is turned away when it is full.

Requests waiting for their first token (queued, encoding, prefilling) are bounded by
`max_waiting_requests`. When a new request finds the bound reached, the lowest class among the
waiting requests and the newcomer is shed: the one the class order (common/policy.py) serves last,
so lower priority first, then `batch` before `interactive`, then the most recent arrival (it has
waited least). A shed request gets an explicit `overloaded` error with a retry-after hint; none is
ever dropped silently. Pure code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from mserve.common.policy import serving_order
from mserve.common.protocol.client import Generate
from mserve.coordinator.records import RequestState


def _serving_order(request: Generate, arrived: float) -> tuple[int, int, float]:
    return serving_order(request.priority, request.latency_class, arrived)


def choose_shed(waiting: Iterable[RequestState], incoming: Generate, now: float) -> RequestState | None:
    """The waiting request to shed so `incoming` can enter, or None when `incoming` itself is shed:
    whichever the class order (common/policy.py) would serve last goes."""
    victim = max(waiting, key=lambda st: _serving_order(st.admitted.request, st.arrived), default=None)
    if victim is None or _serving_order(victim.admitted.request, victim.arrived) <= _serving_order(incoming, now):
        return None
    return victim


class FirstTokenRate:
    """How fast waiting requests get their first token lately: the basis of the retry-after hint."""

    def __init__(self, window: int = 64) -> None:
        self.times: deque[float] = deque(maxlen=window)

    def record(self, now: float) -> None:
        self.times.append(now)

    def retry_after_s(self, waiting: int) -> float:
        """About when the queue ahead of a new request will have drained; 1 s when unknown."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return 1.0
        rate = (len(self.times) - 1) / (self.times[-1] - self.times[0])
        return round(min(60.0, max(0.5, waiting / rate)), 1)
