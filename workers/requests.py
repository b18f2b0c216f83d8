"""One record per request on a worker: what its stage here needs, from the stage message's arrival to its end.

Every role keeps its requests in one `WorkerRequests` table: a record is made when a stage message
(ENCODE, PREFILL, DECODE, RUN) arrives and removed by `end`, the one place a request leaves, when
its stage is reported (finished), failed or cancelled. The engine's sequence is not copied here:
the record points at it, and the scheduler alone knows whether it waits or runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from mserve.workers.sequence import Sequence
    from mserve.workers.token_sinks import TokenRoute


@dataclass
class WorkerRequest:
    request_id: str
    attempt: int  # the coordinator's attempt, echoed in every reply
    origin: str | None = None  # the link (coordinator shard) it came from: every reply goes there
    arrived: float = field(default_factory=time.perf_counter)  # its worker_s counts from here
    # Transfer time (embeddings, KV) not reported yet; None when it fetched nothing.
    fetch_s: float | None = None
    # Its engine sequence (stepping roles): the scheduler matches cached prefix blocks when it first
    # schedules the prompt, after the stage started, so the hit count is read from it at the end.
    seq: Sequence | None = None
    fresh: bool = True  # no token reported yet: the next report is its first
    # Tokens to the coordinator only now and then, and to the client directly (workers/token_sinks.py);
    # None: every step's tokens go to the coordinator.
    route: TokenRoute | None = None
    # Tracing (common/tracing.py): the coordinator's stage span to report under (None: not traced), and
    # what happened here meanwhile, as (name, start ns, end ns, attributes): exported when the record ends.
    trace: str | None = None
    arrived_ns: int = field(default_factory=time.time_ns)
    spans: list[tuple[str, int, int, dict[str, Any]]] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)  # the stage span's, e.g. cache hits
    error: str | None = None  # why the stage failed here, when it did

    def add_fetch(self, seconds: float, what: str = "transfer", end_ns: int | None = None) -> None:
        """A transfer that took `seconds`, ending at `end_ns` (now by default: fetches run on IO threads)."""
        self.fetch_s = (self.fetch_s or 0.0) + seconds
        end_ns = end_ns or time.time_ns()
        self.span(what, end_ns - int(seconds * 1e9), end_ns)

    def span(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """Note a part of the stage for the trace (nothing when the request is not traced)."""
        if self.trace is not None:
            self.spans.append((name, start_ns, end_ns or time.time_ns(), attributes))

    def take_fetch_s(self) -> float | None:
        """The transfer time to report with this output (once: later outputs carry none)."""
        out, self.fetch_s = self.fetch_s, None
        return out

    def worker_s(self) -> float:
        """Time this request's stage spent in this worker (queueing included), for overhead accounting."""
        return round(time.perf_counter() - self.arrived, 6)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens that were already in the pool (prefix hits)."""
        return self.seq.num_cached_tokens if self.seq is not None else 0


class WorkerRequests:
    """The requests a worker holds, by request id: one attempt each (a newer one replaces the older)."""

    def __init__(self) -> None:
        self._by_id: dict[str, WorkerRequest] = {}

    def arrive(self, request_id: str, attempt: int, origin: str | None = None, trace: str | None = None) -> WorkerRequest:
        rec = self._by_id[request_id] = WorkerRequest(request_id, attempt, origin, trace=trace)
        return rec

    def get(self, request_id: str, attempt: int | None = None) -> WorkerRequest | None:
        """The request's record; with `attempt`, only if it is that attempt's."""
        rec = self._by_id.get(request_id)
        return rec if rec is not None and attempt in (None, rec.attempt) else None

    def end(self, request_id: str, attempt: int | None = None) -> WorkerRequest | None:
        """The request's stage here is over: its record goes (with `attempt`, only if it is that attempt's)."""
        rec = self.get(request_id, attempt)
        if rec is not None:
            del self._by_id[request_id]
        return rec

    def origin_of(self, request_id: str) -> str | None:
        rec = self._by_id.get(request_id)
        return rec.origin if rec is not None else None

    def from_origin(self, origin: str) -> list[str]:
        """The requests that came from `origin` (a coordinator shard's link)."""
        return [rid for rid, rec in self._by_id.items() if rec.origin == origin]

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[WorkerRequest]:
        return iter(list(self._by_id.values()))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id
