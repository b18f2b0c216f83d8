"""What the engine-stepping roles (prefill, decode, unified) share: admit a stage, step, stream tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from mserve.common.protocol.to_coordinator import StepTokens, TokenItem, WorkerLoad
from mserve.common.protocol.typed import Message
from mserve.workers.prefix_skip import PREFIX_SKIP_MISSED
from mserve.workers.engine import StepOutput
from mserve.workers.fetcher import FETCH_THREADS, FetchJob, FetchPool
from mserve.workers.requests import WorkerRequest
from mserve.workers.sequence import Sequence
from mserve.workers.token_sinks import TokenRoute, TokenSinks
from mserve.workers.worker import Worker

log = logging.getLogger("mserve.worker")

FETCH_POLL_MS = 2  # the loop's wait for coordinator messages while only fetches are in flight


@dataclass
class Timed:
    """A fetch's result and how long it took, for the request's record (fetch_s, its trace span)."""
    value: Any
    seconds: float
    end_ns: int
    what: str

    def note(self, rec: WorkerRequest) -> Any:
        rec.add_fetch(self.seconds, self.what, end_ns=self.end_ns)
        return self.value


class SteppingWorker(Worker):
    """Runs one engine step per loop turn over every request it holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = TokenSinks(self.ctx)
        self.fetches = FetchPool(FETCH_THREADS)  # transfers off the loop thread (workers/fetcher.py)

    def transfers(self, task: Message) -> Callable[[], Any] | None:
        """What the stage must fetch before it can start (run on an IO thread, workers/fetcher.py), or
        None when it brings everything along."""
        return None

    def add(self, task: Message, rec: WorkerRequest, fetched: Any) -> Sequence:
        """Put the stage's request into the engine, with what `transfers` fetched; its sequence."""
        raise NotImplementedError

    def release_fetched(self, fetched: Any) -> None:
        """What `transfers` fetched for a request that left meanwhile (a role holding views acks them)."""

    def start(self, task: Message) -> None:
        rid = task.request_id
        rec = self.requests.get(rid, task.attempt)
        assert rec is not None, f"{rid}: a stage starts only on arrival"
        self.engine.abort(rid)  # an older attempt of the same request may still be here
        self.fetches.forget(rid)  # ... or still fetching
        pull = self.transfers(task)
        if pull is None:
            self._admit(task, rec, None)
            return
        self.submit_fetch(rid, task.attempt, pull, lambda got: self._admit(task, rec, got),
                          release=self.release_fetched)

    def submit_fetch(self, rid: str, attempt: int, pull: Callable[[], Any], admit: Callable[[Any], None],
                     release: Callable[[Any], None] | None = None) -> None:
        """Fetch on an IO thread; `admit` the result on the loop, or fail the attempt as a fetch there would."""
        def fail(exc: BaseException) -> None:
            def reraise() -> None:
                raise exc
            self.guarded(rid, attempt, reraise)

        self.fetches.submit(FetchJob(rid, pull, admit, fail, release))

    def _admit(self, task: Message, rec: WorkerRequest, fetched: Any) -> None:
        def admit() -> None:
            rec.seq = self.add(task, rec, fetched)

        if not self.guarded(task.request_id, task.attempt, admit):
            return  # failed: the record and anything in the engine are gone
        every = getattr(task, "report_every", 1)
        if every > 1:
            rec.route = TokenRoute(every, task.tokens_to, task.client_rid, len(rec.seq.output_ids),
                                   len(rec.seq.prompt_ids), model=self.model_name)
            # The tokens made before this worker (the prefill's first, an earlier attempt's) to the sink
            # too, so the client's stream need not wait for the coordinator's relay of them
            # (workers/token_sinks.py; the client drops a token it already has).
            self.sinks.push(rec.route, list(rec.seq.output_ids), index=0)

    def end(self, rid: str, attempt: int | None = None) -> WorkerRequest | None:
        rec = super().end(rid, attempt)
        if rec is not None or attempt is None:
            self.fetches.forget(rid)  # what its fetches still bring is released, never admitted
        return rec

    def busy(self) -> bool:
        return self.engine.has_unfinished() or self.fetches.in_flight() > 0

    def poll_ms(self) -> int:
        # Only fetches in flight: no busy spin, but their requests start within a few ms of arriving.
        if self.engine.has_unfinished():
            return 0
        return FETCH_POLL_MS if self.fetches.in_flight() else super().poll_ms()

    def queued_ids(self) -> list[str]:
        """The engine's waiting requests and those still fetching what they need to join it."""
        fetching = [rec.request_id for k in self.fetches.keys()
                    if (rec := self.requests.get(k) if isinstance(k, str) else None) is not None and rec.seq is None]
        return super().queued_ids() + fetching

    def close(self) -> None:
        self.fetches.close()
        self.sinks.close()
        super().close()

    def load(self) -> WorkerLoad:
        load = super().load()
        if load.counters is not None and (self.sinks.sent or self.sinks.dropped):  # TOKENS to clients' sinks, dropped
            load.counters.update(tokens_direct=self.sinks.sent, tokens_direct_dropped=self.sinks.dropped)
        return load

    def fetch(self, descriptor: Any, what: str = "embedding.transfer") -> Timed:
        """On an IO thread: one transfer, timed for the request's record (`Timed.note`, on the loop)."""
        t0 = time.perf_counter()
        tensors = self.transfer.fetch(descriptor, timeout_s=self.s.fetch_timeout_s)
        return Timed(tensors, time.perf_counter() - t0, time.time_ns(), what)

    def work(self) -> None:
        for job in self.fetches.ready():  # stages whose transfers came in join the batch
            if job.error is None:
                job.admit(job.result)
            else:
                job.fail(job.error)
        if not self.engine.has_unfinished():
            return
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing its requests")
            for seq in self.engine.scheduler.sequences():
                rec = self.requests.get(seq.request_id)
                self.engine.abort(seq.request_id)
                if rec is not None:
                    self.failed(rec.request_id, rec.attempt, f"engine step failed: {exc.__class__.__name__}: {exc}",
                                retryable=True)
            return
        self.report(outputs)
        for rid in self.engine.take_unresolved():  # workers/prefix_skip.py: the coordinator encodes them again
            rec = self.requests.get(rid)
            if rec is not None:
                self.failed(rid, rec.attempt, f"{PREFIX_SKIP_MISSED}: images skipped for the cached prefix must be "
                            "encoded after all", retryable=True)

    def finishing(self, rec: WorkerRequest, item: TokenItem, out: StepOutput) -> None:
        """A request's last tokens are about to go out: a role may add to them."""

    def report(self, outputs: list[StepOutput]) -> None:
        """Stream every request's new tokens in one STEP_TOKENS message."""
        items, finished = [], []
        for out in outputs:
            rec = self.requests.get(out.request_id)
            if rec is None:  # cancelled (or failed) meanwhile
                continue
            self.count_tokens(len(out.new_token_ids))
            tokens = out.new_token_ids
            if rec.route is not None:
                self.sinks.push(rec.route, tokens)
                tokens = rec.route.take(tokens, must_report=out.finished or rec.fresh)
                if tokens is None:
                    continue
            item = TokenItem(request_id=rec.request_id, attempt=rec.attempt, token_ids=tokens, finished=out.finished,
                             finish_reason=out.finish_reason, first=rec.fresh, fetch_s=rec.take_fetch_s())
            rec.fresh = False
            if out.finished:
                finished.append(rec)
                item.worker_s = rec.worker_s()
                item.cached_tokens = rec.cached_tokens
                self.finishing(rec, item, out)
            items.append(item)
        if items:
            self.send(StepTokens(items=items))
        for rec in finished:  # after the send: each item goes to the shard its record came from
            self.end(rec.request_id)
