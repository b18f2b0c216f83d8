"""The request machine's handlers for a worker's reply to a stage: ENCODED, PREFILLED, STEP_TOKENS, FAILED.

Owned by the request machine (coordinator/requests.py), whose step hands each decoded reply to one
`on_*` method while it updates request state. A handler finds the live attempt the reply is about
(stale replies of an earlier attempt or a re-routed stage are dropped), records what it brought, and
then either queues the next stage (`Dispatcher.advance`, coordinator/dispatch.py) or re-runs or ends
the request (`Lifecycle`, coordinator/lifecycle.py); the step's schedule phase sends what was queued.
"""

from __future__ import annotations

from mserve.common.protocol import ErrorCode
from mserve.common.protocol.to_coordinator import Encoded, Failed, Prefilled, TokenItem
from mserve.common.protocol.to_worker import AdoptBlocks, Cancel, Embeddings
from mserve.coordinator.context import Context
from mserve.coordinator.dispatch import Dispatcher
from mserve.coordinator.lifecycle import Lifecycle
from mserve.coordinator.records import RequestState, Stage, direct_tokens, part_message
from mserve.coordinator.telemetry import modality


class StageReplies:
    def __init__(self, ctx: Context, dispatch: Dispatcher, life: Lifecycle) -> None:
        self.ctx, self.dispatch, self.life = ctx, dispatch, life

    def _current(self, worker_id: str, reply: Encoded | Prefilled | TokenItem, stage: Stage) -> RequestState | None:
        """The request a worker reply is about, if that reply is still the live attempt of that stage."""
        st = self.ctx.requests.get(reply.request_id)
        if st is None or st.attempt != reply.attempt or st.stage != stage or st.worker_id != worker_id:
            return None  # stale: an earlier attempt, a re-routed stage, or an aborted request
        return st

    def on_encoded(self, worker_id: str, msg: Encoded) -> None:
        for im in msg.images:
            self.ctx.members.add_holder(im.hash, worker_id)
        spread = self.ctx.requests.get(msg.request_id)
        if spread is not None and spread.parts:
            return self._on_encoded_part(spread, worker_id, msg)
        st = self._current(worker_id, msg, Stage.ENCODE)
        if st is None:
            return
        self.life.stage_done(st, "encode_s")
        st.timings["worker_s"] += msg.worker_s
        self.ctx.telemetry.on_encoded(modality(st.admitted.images), msg.worker_s, msg.preprocess_s)
        st.embeddings, st.embeddings_from = msg.descriptor, worker_id
        st.image_grids = [im.grid for im in msg.images]
        st.cache_hits["embedding"] += msg.cache_hits
        st.next_stage = Stage.PREFILL
        self.dispatch.advance(st)

    def _on_encoded_part(self, st: RequestState, worker_id: str, msg: Encoded) -> None:
        """One encoder's share of a spread ENCODE. The first part in sends the request on to prefill,
        which computes the prompt up to the first image still encoding (its KV blocks reserved
        meanwhile); each later part follows it there as EMBEDDINGS."""
        part = next((p for p in st.parts if p.worker_id == worker_id), None)
        if st.attempt != msg.attempt or part is None or part.descriptor is not None:
            return  # stale: an earlier attempt, or a part already in
        part.descriptor, part.grids = msg.descriptor, [im.grid for im in msg.images]
        self.dispatch.uncharge(st, worker_id)
        st.timings["worker_s"] += msg.worker_s
        self.ctx.telemetry.on_encoded(modality(st.admitted.images), msg.worker_s, msg.preprocess_s)
        st.cache_hits["embedding"] += msg.cache_hits
        grids: list = [None] * len(st.admitted.images)
        for p in st.parts:
            for i, grid in zip(p.images, p.grids or []):
                grids[i] = grid
        st.image_grids = grids
        if all(p.descriptor is not None for p in st.parts):
            st.timings["encode_s"] += self.ctx.now - st.encode_started
        if st.stage == Stage.ENCODE:
            st.next_stage = Stage.PREFILL
            self.dispatch.advance(st)  # its PREFILL carries every part in by the time a prefill worker takes it
        elif st.stage == Stage.PREFILL and st.worker_id is not None:
            more = Embeddings(request_id=st.rid, attempt=st.attempt, parts=[part_message(part)])
            self.ctx.outbox.to_worker(st.worker_id, more)

    def on_prefilled(self, worker_id: str, msg: Prefilled) -> None:
        st = self._current(worker_id, msg, Stage.PREFILL)
        if st is None:
            return
        self.life.stage_done(st, "prefill_s")
        st.timings["transfer_s"] += msg.fetch_s
        st.timings["worker_s"] += msg.worker_s
        st.cache_hits["prefix_tokens"] += msg.cached_tokens
        self._count_skipped(st, msg.skipped_images)
        self.life.emit(st, [msg.token_id])
        if msg.finish_reason != "prefilled":
            return self.life.end(st, finish_reason=msg.finish_reason)
        if msg.descriptor is None or msg.state is None:
            return self.life.restart(st, reason=f"{worker_id} prefilled without handing over its KV")
        st.kv, st.kv_from = {"descriptor": msg.descriptor, "state": msg.state}, worker_id
        st.next_stage = Stage.DECODE
        self.dispatch.advance(st)

    def on_step_tokens(self, worker_id: str, item: TokenItem) -> None:
        worker = self.ctx.members.get(worker_id)
        assert worker is not None  # the machine hands on replies of registered workers only
        stage = Stage.RUN if worker.role == "unified" else Stage.DECODE
        st = self._current(worker_id, item, stage)
        local = st is None and stage == Stage.DECODE and item.first
        if local:  # a PREFILL lent to this decode worker (dispatch.py `_local_prefill`): it decodes on
            st = self._current(worker_id, item, Stage.PREFILL)
        if st is None:
            if item.request_id not in self.ctx.requests and not item.finished:
                # Nobody waits for it (a coordinator before this one admitted it): free the worker.
                self.ctx.outbox.to_worker(worker_id, Cancel(request_id=item.request_id))
            return
        self.ctx.counters.count("token_items")
        st.timings["transfer_s"] += item.fetch_s or 0.0
        now = self.ctx.now
        st.deadline = now + self.ctx.settings.stage_timeout_s  # progress resets the stage timeout
        if (stage == Stage.RUN or local) and item.first:  # unified, local: time to the first token is its prefill
            st.timings["prefill_s"] += now - st.stage_started
            st.stage, st.stage_started = stage, now
            self.dispatch.prefill_done(st)  # its prompt is no longer work waiting on that worker
        # Direct tokens: the worker streamed these to the client itself; here they are only recorded.
        self.life.emit(st, item.token_ids, relay=not direct_tokens(st, self.ctx.settings.token_report_every))
        if item.finished:
            st.timings["worker_s"] += item.worker_s or 0.0
            self.life.stage_done(st, "decode_s")
            st.cache_hits["prefix_tokens"] += item.cached_tokens or 0
            st.cache_hits["embedding"] += item.embedding_hits or 0  # unified: its own embedding tiers
            self._count_skipped(st, item.skipped_images or 0)
            if item.hand_back and st.kv_from and self.ctx.members.is_alive(st.kv_from):
                # The reply's KV blocks go to the prefill worker holding the prompt's, for the next turn.
                adopt = AdoptBlocks(request_id=st.rid, **item.hand_back.fields())
                self.ctx.outbox.to_worker(st.kv_from, adopt)
            self.life.end(st, finish_reason=item.finish_reason or "stop")

    def _count_skipped(self, st: RequestState, skipped: int) -> None:
        """Images the request's prefill did without encoding: the cached prefix held them."""
        if skipped:
            st.cache_hits["skipped_by_prefix"] = st.cache_hits.get("skipped_by_prefix", 0) + skipped
            self.ctx.counters.count("encodes_skipped_by_prefix", skipped)

    def on_failed(self, worker_id: str, msg: Failed) -> None:
        st = self.ctx.requests.get(msg.request_id)
        if st is None or st.attempt != msg.attempt or worker_id not in st.stage_workers() | {st.worker_id}:
            return  # stale, or from a worker this attempt no longer runs on
        self.dispatch.uncharge(st)
        if msg.retryable:
            self.life.restart(st, reason=f"{worker_id}: {msg.message}")
        else:
            self.life.cancel_on_worker(st, skip=worker_id)  # other encoders' parts, embeddings parked for it
            self.life.end(st, error=(ErrorCode.BAD_REQUEST, msg.message))

