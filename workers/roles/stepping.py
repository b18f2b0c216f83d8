"""What the engine-stepping roles (prefill, decode, unified) share: admit a stage, step, stream tokens."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mserve.common.protocol.to_coordinator import StepTokens, TokenItem
from mserve.common.protocol.typed import Message
from mserve.workers.prefix_skip import PREFIX_SKIP_MISSED
from mserve.workers.engine import StepOutput
from mserve.workers.requests import WorkerRequest
from mserve.workers.sequence import Sequence
from mserve.workers.token_sinks import TokenRoute, TokenSinks
from mserve.workers.worker import FETCH_TIMEOUT_S, Worker

log = logging.getLogger("mserve.worker")


class SteppingWorker(Worker):
    """Runs one engine step per loop turn over every request it holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = TokenSinks(self.ctx)

    def add(self, task: Message, rec: WorkerRequest) -> Sequence:
        """Put the stage's request into the engine (fetching what it needs first); its sequence."""
        raise NotImplementedError

    def start(self, task: Message) -> None:
        rid = task.request_id
        rec = self.requests.get(rid, task.attempt)
        assert rec is not None, f"{rid}: a stage starts only on arrival"
        self.engine.abort(rid)  # an older attempt of the same request may still be here

        def admit() -> None:
            rec.seq = self.add(task, rec)

        if not self.guarded(rid, task.attempt, admit):
            return  # failed: the record and anything in the engine are gone
        every = getattr(task, "report_every", 1)
        if every > 1:
            rec.route = TokenRoute(every, task.tokens_to, task.client_rid, len(rec.seq.output_ids),
                                   len(rec.seq.prompt_ids), model=self.model_name)

    def close(self) -> None:
        self.sinks.close()
        super().close()

    def load(self) -> dict[str, Any]:
        load = super().load()
        if self.sinks.sent or self.sinks.dropped:  # TOKENS pushed to clients' sinks, and those dropped
            load["counters"].update(tokens_direct=self.sinks.sent, tokens_direct_dropped=self.sinks.dropped)
        return load

    def fetch(self, rec: WorkerRequest, descriptor: Any) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        tensors = self.transfer.fetch(descriptor, timeout_s=FETCH_TIMEOUT_S)
        rec.add_fetch(time.perf_counter() - t0, "embedding.transfer")
        return tensors

    def work(self) -> None:
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
