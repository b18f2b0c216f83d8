"""The request machine's handlers for a worker's reply to a stage: ENCODED, PREFILLED, STEP_TOKENS, FAILED.

A mixin of RequestMachine (coordinator/requests.py), split out to keep each module readable: every
handler finds the live attempt the reply is about (stale replies of an earlier attempt or a
re-routed stage are dropped), records what it brought, and advances or ends the request.
"""

from __future__ import annotations

from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.to_coordinator import Encoded, Failed, Prefilled, TokenItem
from mserve.common.protocol.to_worker import Embeddings
from mserve.coordinator.records import RequestState, Stage, ToWorker, direct_tokens, part_message

class StageReplies:
    """Mixed into RequestMachine: uses its requests, members, _advance, _restart, _emit and _end."""

    def _current(self, worker_id: str, reply: Encoded | Prefilled | TokenItem, stage: Stage) -> RequestState | None:
        """The request a worker reply is about, if that reply is still the live attempt of that stage."""
        st = self.requests.get(reply.request_id)
        if st is None or st.attempt != reply.attempt or st.stage != stage or st.worker_id != worker_id:
            return None  # stale: an earlier attempt, a re-routed stage, or an aborted request
        return st

    def _on_encoded(self, worker_id: str, msg: Encoded) -> None:
        for im in msg.images:
            self.members.add_holder(im.hash, worker_id)
        spread = self.requests.get(msg.request_id)
        if spread is not None and spread.parts:
            return self._on_encoded_part(spread, worker_id, msg)
        st = self._current(worker_id, msg, Stage.ENCODE)
        if st is None:
            return
        self._stage_done(st, "encode_s")
        st.timings["worker_s"] += msg.worker_s
        st.embeddings, st.embeddings_from = msg.descriptor, worker_id
        st.image_grids = [im.grid for im in msg.images]
        st.cache_hits["embedding"] += msg.cache_hits
        st.next_stage = Stage.PREFILL
        self._advance(st)

    def _on_encoded_part(self, st: RequestState, worker_id: str, msg: Encoded) -> None:
        """One encoder's share of a spread ENCODE. The first part in sends the request on to prefill,
        which computes the prompt up to the first image still encoding (its KV blocks reserved
        meanwhile); each later part follows it there as EMBEDDINGS."""
        part = next((p for p in st.parts if p.worker_id == worker_id), None)
        if st.attempt != msg.attempt or part is None or part.descriptor is not None:
            return  # stale: an earlier attempt, or a part already in
        part.descriptor, part.grids = msg.descriptor, [im.grid for im in msg.images]
        self._uncharge(st, worker_id)
        st.timings["worker_s"] += msg.worker_s
        st.cache_hits["embedding"] += msg.cache_hits
        grids: list = [None] * len(st.admitted.images)
        for p in st.parts:
            for i, grid in zip(p.images, p.grids or []):
                grids[i] = grid
        st.image_grids = grids
        if all(p.descriptor is not None for p in st.parts):
            st.timings["encode_s"] += self._now - st.encode_started
        if st.stage == Stage.ENCODE:
            st.next_stage = Stage.PREFILL
            self._advance(st)  # its PREFILL carries every part in by the time a prefill worker takes it
        elif st.stage == Stage.PREFILL and st.worker_id is not None:
            more = Embeddings(request_id=st.rid, attempt=st.attempt, parts=[part_message(part)])
            self._out.append(ToWorker(st.worker_id, MsgType.EMBEDDINGS, more.fields()))

    def _on_prefilled(self, worker_id: str, msg: Prefilled) -> None:
        st = self._current(worker_id, msg, Stage.PREFILL)
        if st is None:
            return
        self._stage_done(st, "prefill_s")
        st.timings["transfer_s"] += msg.fetch_s
        st.timings["worker_s"] += msg.worker_s
        st.cache_hits["prefix_tokens"] += msg.cached_tokens
        self._emit(st, [msg.token_id])
        if msg.finish_reason != "prefilled":
            return self._end(st, finish_reason=msg.finish_reason)
        if msg.descriptor is None or msg.state is None:
            return self._restart(st, reason=f"{worker_id} prefilled without handing over its KV")
        st.kv, st.kv_from = {"descriptor": msg.descriptor, "state": msg.state}, worker_id
        st.next_stage = Stage.DECODE
        self._advance(st)

    def _on_step_tokens(self, worker_id: str, item: TokenItem) -> None:
        stage = Stage.RUN if self.members.workers[worker_id].role == "unified" else Stage.DECODE
        st = self._current(worker_id, item, stage)
        if st is None:
            if item.request_id not in self.requests and not item.finished:
                # Nobody waits for it (a coordinator before this one admitted it): free the worker.
                self._out.append(ToWorker(worker_id, MsgType.CANCEL, {"request_id": item.request_id}))
            return
        self.stats["token_items"] += 1
        st.timings["transfer_s"] += item.fetch_s or 0.0
        now = self._now
        st.deadline = now + self.stage_timeout_s  # progress resets the stage timeout
        if stage == Stage.RUN and item.first:  # unified: time to the first token is its prefill
            st.timings["prefill_s"] += now - st.stage_started
            st.stage_started = now
        # Direct tokens: the worker streamed these to the client itself; here they are only recorded.
        self._emit(st, item.token_ids, relay=not direct_tokens(st, self.token_report_every))
        if item.finished:
            st.timings["worker_s"] += item.worker_s or 0.0
            self._stage_done(st, "decode_s")
            st.cache_hits["prefix_tokens"] += item.cached_tokens or 0
            if item.hand_back and st.kv_from and self.members.is_alive(st.kv_from):
                # The reply's KV blocks go to the prefill worker holding the prompt's, for the next turn.
                self._out.append(ToWorker(st.kv_from, MsgType.ADOPT, {"request_id": st.rid, **item.hand_back.fields()}))
            self._end(st, finish_reason=item.finish_reason or "stop")

    def _on_failed(self, worker_id: str, msg: Failed) -> None:
        st = self.requests.get(msg.request_id)
        if st is None or st.attempt != msg.attempt or worker_id not in st.stage_workers() | {st.worker_id}:
            return  # stale, or from a worker this attempt no longer runs on
        self._uncharge(st)
        if msg.retryable:
            self._restart(st, reason=f"{worker_id}: {msg.message}")
        else:
            self._cancel_on_worker(st, skip=worker_id)  # other encoders' parts, embeddings parked for it
            self._end(st, error=(ErrorCode.BAD_REQUEST, msg.message))

