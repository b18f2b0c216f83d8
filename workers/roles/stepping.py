"""What the engine-stepping roles (prefill, decode, unified) share: admit a stage, step, stream tokens."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mserve.common.protocol.to_coordinator import StepTokens, TokenItem
from mserve.common.protocol.typed import Message
from mserve.workers.engine import StepOutput
from mserve.workers.token_sinks import TokenRoute, TokenSinks
from mserve.workers.worker import FETCH_TIMEOUT_S, Worker

log = logging.getLogger("mserve.worker")


class SteppingWorker(Worker):
    """Runs one engine step per loop turn over every request it holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts: dict[str, int] = {}  # engine request id -> coordinator attempt
        self.fetch_s: dict[str, float] = {}  # transfer time to report with a request's first output
        # Each request's sequence, read when it reports: the scheduler matches cached prefix blocks
        # when it first schedules the prompt, after `add`, so the hit count is only known then.
        self.seqs: dict[str, Any] = {}
        self.fresh: set[str] = set()  # requests that have not reported a token yet
        # Requests whose tokens go to the coordinator only now and then, and to the client directly
        # (workers/token_sinks.py); the rest report every step.
        self.routes: dict[str, TokenRoute] = {}
        self.sinks = TokenSinks(self.ctx)

    def add(self, task: Message) -> None:
        """Put the stage's request into the engine (fetching what it needs first)."""
        raise NotImplementedError

    def start(self, task: Message) -> None:
        rid, attempt = task.request_id, task.attempt
        self.engine.abort(rid)  # an older attempt of the same request may still be here
        if not self.guarded(rid, attempt, lambda: self.add(task)):
            self.engine.abort(rid)
            self._forget(rid)
            return
        self.attempts[rid] = attempt
        self.fresh.add(rid)
        every = getattr(task, "report_every", 1)
        seq = self.engine.scheduler.get(rid)
        if every > 1 and seq is not None:
            self.routes[rid] = TokenRoute(every, task.tokens_to, task.client_rid, len(seq.output_ids),
                                          len(seq.prompt_ids))

    def close(self) -> None:
        self.sinks.close()
        super().close()

    def load(self) -> dict[str, Any]:
        load = super().load()
        if self.sinks.sent or self.sinks.dropped:  # TOKENS pushed to clients' sinks, and those dropped
            load["counters"].update(tokens_direct=self.sinks.sent, tokens_direct_dropped=self.sinks.dropped)
        return load

    def cancel(self, rid: str) -> None:
        self._forget(rid)
        super().cancel(rid)
        self.attempts.pop(rid, None)

    def _forget(self, rid: str) -> None:
        for table in (self.fetch_s, self.seqs, self.routes):
            table.pop(rid, None)
        self.fresh.discard(rid)

    def cached_tokens(self, rid: str) -> int:
        """Prompt tokens of `rid` that were already in the pool (prefix hits); forgets the request."""
        seq = self.seqs.pop(rid, None)
        return seq.num_cached_tokens if seq is not None else 0

    def fetch(self, rid: str, descriptor: Any) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        tensors = self.transfer.fetch(descriptor, timeout_s=FETCH_TIMEOUT_S)
        self.fetch_s[rid] = self.fetch_s.get(rid, 0.0) + time.perf_counter() - t0
        return tensors

    def work(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing its requests")
            for rid in [seq.request_id for seq in self.engine.scheduler.sequences()]:
                attempt = self.attempts.pop(rid, None)
                self.engine.abort(rid)
                if attempt is not None:
                    self._forget(rid)
                    self.failed(rid, attempt, f"engine step failed: {exc.__class__.__name__}: {exc}", retryable=True)
            return
        self.report(outputs)

    def finishing(self, rid: str, attempt: int, item: TokenItem, out: StepOutput) -> None:
        """A request's last tokens are about to go out: a role may add to them."""

    def report(self, outputs: list[StepOutput]) -> None:
        """Stream every request's new tokens in one STEP_TOKENS message."""
        items = []
        for out in outputs:
            rid = out.request_id
            attempt = self.attempts.get(rid)
            if attempt is None:
                continue
            self.count_tokens(len(out.new_token_ids))
            tokens = out.new_token_ids
            route = self.routes.get(rid)
            if route is not None:
                self.sinks.push(route, tokens)
                tokens = route.take(tokens, must_report=out.finished or rid in self.fresh)
                if tokens is None:
                    continue
            item = TokenItem(request_id=rid, attempt=attempt, token_ids=tokens, finished=out.finished,
                             finish_reason=out.finish_reason, first=rid in self.fresh, fetch_s=self.fetch_s.pop(rid, None))
            self.fresh.discard(rid)
            if out.finished:
                self.attempts.pop(rid, None)
                self.routes.pop(rid, None)
                item.worker_s = self.worker_s(rid)
                item.cached_tokens = self.cached_tokens(rid)
                self.finishing(rid, attempt, item, out)
            items.append(item)
        if items:
            self.send(StepTokens(items=items))
