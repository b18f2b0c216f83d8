"""A request's life at the coordinator: (re)run from its first stage, tokens out, the end, a worker's death.

Owned by the request machine (coordinator/requests.py) and called by it and by the reply handlers
(coordinator/replies.py) while a step updates request state. Pure: it appends what must be sent to
the step's Outbox, queues stages through the Dispatcher, and never touches a socket.
"""

from __future__ import annotations

import logging
from typing import Any

from mserve.common.protocol import ErrorCode
from mserve.common.protocol.client import Tokens
from mserve.common.protocol.to_worker import Cancel
from mserve.coordinator.context import Context
from mserve.coordinator.dispatch import Dispatcher
from mserve.coordinator.records import RequestState, Stage, result_message

log = logging.getLogger("mserve.coordinator")


class Lifecycle:
    def __init__(self, ctx: Context, dispatch: Dispatcher) -> None:
        self.ctx, self.dispatch = ctx, dispatch

    def restart(self, st: RequestState, first: bool = False, reason: str = "", ran: bool = True) -> None:
        """(Re)run a request from its first stage, keeping the tokens the client already has. `ran`:
        False when the attempt's stage never reached a worker (it is not counted against max_attempts)."""
        if not first:
            self.ctx.counters.count("reruns")
            st.undelivered += not ran
            self.cancel_on_worker(st)  # the stage may still be running on a live worker
            if st.attempt + 1 - st.undelivered >= self.ctx.settings.max_attempts:
                unsent = f" ({st.undelivered} never reached a worker)" if st.undelivered else ""
                self.end(st, error=(ErrorCode.INTERNAL, f"gave up after {st.attempt + 1} attempts{unsent}: {reason}"))
                return
            log.warning("%s re-run (attempt %d): %s", st.client_rid, st.attempt + 2, reason)
            if st.trace is not None:
                st.trace.stage_ended(error=f"re-run: {reason}")
            st.attempt += 1
        st.deadline = 0.0
        st.embeddings = st.kv = st.embeddings_from = st.kv_from = None
        st.parts = []
        if st.skipped_images:  # the skip may be why it failed (the prefix blocks were gone): encode every image
            st.prefix_skip_off, st.skipped_images, st.skip_prefill = True, [], None
        st.next_stage = Stage.START
        self.dispatch.advance(st)

    def stage_done(self, st: RequestState, timing_key: str) -> None:
        st.timings[timing_key] += self.ctx.now - st.stage_started
        self.dispatch.uncharge(st)
        if st.trace is not None:
            st.trace.stage_ended()

    def emit(self, st: RequestState, tokens: list[int], relay: bool = True) -> None:
        now = self.ctx.now
        index = len(st.output_ids)
        if index == 0:
            self.ctx.first_tokens.record(now)
            st.first_token_at = now
        st.output_ids.extend(tokens)
        if st.admitted.request.stream and relay:
            # At index 0 the prompt's size too: a client that stops early (a stop string) still learns it.
            msg = Tokens(request_id=st.client_rid, index=index, token_ids=tokens,
                         prompt_tokens=len(st.admitted.prompt_ids) if index == 0 else None,
                         model=st.admitted.model if index == 0 else None)
            self.ctx.outbox.to_client(st.client, msg)

    def end(self, st: RequestState, *, finish_reason: str | None = None, error: tuple[str, str] | None = None,
            **error_extra: Any) -> None:
        now = self.ctx.now
        self.dispatch.uncharge(st)
        self.dispatch.forget(st)
        self.ctx.requests.remove(st)
        if st.trace is not None:
            st.trace.finish({"mserve.attempts": st.attempt + 1, "mserve.output_tokens": len(st.output_ids),
                             "mserve.finish_reason": finish_reason, "mserve.embedding_cache_hits":
                             st.cache_hits["embedding"], "mserve.prefix_cache_hit_tokens": st.cache_hits["prefix_tokens"]},
                            error=None if error is None else f"{error[0]}: {error[1]}")
        if error is not None:
            self.ctx.counters.count("failed")
            log.warning("%s failed: %s", st.client_rid, error[1])
            return self.ctx.outbox.error(st.client, st.client_rid, *error, **error_extra)
        self.ctx.counters.count("completed")
        self.ctx.telemetry.on_request(st, now)
        log.info("%s done: %d tokens (%s) in %.0f ms", st.client_rid, len(st.output_ids), finish_reason,
                 (now - st.arrived) * 1e3)
        self.ctx.outbox.to_client(st.client, result_message(st, finish_reason or "stop",
                                                            self.ctx.detokenize(st.output_ids), now))

    def cancel_on_worker(self, st: RequestState, skip: str | None = None) -> None:
        """CANCEL the request wherever it runs or has data parked (but on `skip`, which already gave up on it)."""
        targets = st.stage_workers()
        if st.embeddings is not None or st.parts:
            # Embeddings parked on encoders for a prefill that will not come: let them free them now
            # rather than at the transfer's expiry.
            targets |= st.embedding_sources()
        for worker_id in sorted(targets - {skip}):
            if self.ctx.members.is_alive(worker_id):
                self.ctx.outbox.to_worker(worker_id, Cancel(request_id=st.rid))

    def worker_died(self, worker_id: str, why: str, undelivered: str | None = None) -> None:
        """Declare the worker dead and re-run every request that needs it. `undelivered`: the request
        whose stage message to it never got there (that attempt does not count)."""
        w = self.ctx.members.mark_dead(worker_id)
        if w is None:
            return
        log.warning("worker %s (%s) is gone: %s", worker_id, w.role, why)
        self.ctx.lookups.forget(worker_id)  # the prompts routed to it are cached nowhere now
        for st in self.ctx.requests.values():
            # Its stage ran there, or data it still needs (embeddings, prefilled KV) was parked there.
            if st.needs(worker_id):
                if worker_id in st.stage_workers():
                    self.ctx.members.abandon(worker_id, st.rid)
                self.dispatch.uncharge(st)
                ran = not (st.rid == undelivered and st.worker_id == worker_id)
                self.restart(st, reason=f"worker {worker_id} {why}", ran=ran)
