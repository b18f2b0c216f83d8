"""The coordinator: admits client requests and walks each one through encode -> prefill -> decode.

One thread, one poll loop over two ROUTER sockets (clients, workers). It holds every request's
state machine, routes each stage with coordinator/routing.py, relays transfer descriptors between
workers (tensors move worker-to-worker, never through here), streams tokens back, and re-runs a
request on another worker when its worker dies or a stage times out.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from mserve.common.protocol import (CLIENT_TO_COORDINATOR, ROLES, WORKER_TO_COORDINATOR, ErrorCode, MsgType, ProtocolError,
                             body, validate)
from mserve.common.redis_store import RedisStore
from mserve.common.serde import WireError, decode
from mserve.common.sockets import make_socket, send
from mserve.coordinator.admission import Admitted, AdmissionError, Limits, admit
from mserve.coordinator.routing import WorkerView, pipeline_for, route_decode, route_encode, route_prefill, route_unified
from mserve.coordinator.settings import CoordinatorSettings
from mserve.common.hashing import ImageSpan, prompt_block_hashes

log = logging.getLogger("mserve.coordinator")

ACTIVE_STAGES = ("encode", "prefill", "decode", "run")


@dataclass
class RequestState:
    rid: str  # coordinator-internal id, unique across clients
    client: bytes
    admitted: Admitted
    arrived: float
    attempt: int = 0
    next_stage: str = "start"
    stage: str = "queued"
    worker_id: str | None = None
    stage_started: float = 0.0
    deadline: float = 0.0
    embeddings: dict | None = None  # descriptor of the encoded images (on an encode worker)
    embeddings_from: str | None = None
    image_grids: list | None = None
    kv: dict | None = None  # descriptor + state of the prefilled request (on a prefill worker)
    kv_from: str | None = None
    output_ids: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in (
        "queue_s", "encode_s", "prefill_s", "transfer_s", "decode_s", "worker_s")})
    cache_hits: dict[str, int] = field(default_factory=lambda: {"embedding": 0, "prefix_tokens": 0})
    charged: tuple[str, int] | None = None

    @property
    def client_rid(self) -> str:
        return self.admitted.request.request_id

    @property
    def has_images(self) -> bool:
        return bool(self.admitted.images)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        from mserve.common.prompt import PromptBuilder

        self.settings = settings
        self.builder = PromptBuilder(settings.model)
        self.model_name = settings.model_name or settings.model
        self.limits = Limits(**settings.limits())
        self.ctx = zmq.Context.instance()
        self.client_sock = make_socket(self.ctx, zmq.ROUTER, bind=settings.bind)
        self.worker_sock = make_socket(self.ctx, zmq.ROUTER, bind=settings.worker_bind)
        self.store = RedisStore(settings.redis) if settings.redis else None
        self.workers: dict[str, WorkerView] = {}
        self.worker_info: dict[str, dict[str, Any]] = {}
        self.last_seen: dict[str, float] = {}
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.pending: deque[str] = deque()
        self.embedding_holders: dict[str, set[str]] = {}
        # Requests moved off a worker declared dead: cancelled there if it turns out to be alive.
        self.abandoned: dict[str, set[str]] = {}
        self.block_size = 16
        self.stats = {"admitted": 0, "rejected": 0, "completed": 0, "failed": 0, "reruns": 0}
        self._running = True
        self._next_redis_sync = 0.0

    # -- loop --------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.client_sock, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        log.info("coordinator ready: clients %s, workers %s, model %s", self.settings.bind, self.settings.worker_bind,
                 self.model_name)
        while self._running:
            events = dict(poller.poll(timeout=20))
            # Worker messages first: finishing work frees capacity for new requests.
            for _ in range(256):
                if not self._drain_one(self.worker_sock, self._on_worker_frames):
                    break
            if self.client_sock in events:
                for _ in range(256):
                    if not self._drain_one(self.client_sock, self._on_client_frames):
                        break
            self._tick(time.monotonic())

    def stop(self) -> None:
        self._running = False

    def close(self) -> None:
        self.client_sock.close(0)
        self.worker_sock.close(0)
        if self.store:
            self.store.close()

    @staticmethod
    def _drain_one(sock: zmq.Socket, handler) -> bool:
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        try:
            handler(frames)
        except Exception:  # a message that validates but is wrong inside must not stop serving
            log.exception("error while handling a message; the coordinator keeps serving")
        return True

    # -- clients -------------------------------------------------------------------------------------
    def _reply(self, client: bytes, kind: MsgType, payload: dict[str, Any]) -> None:
        try:
            send(self.client_sock, kind, body(**payload), identity=client, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # client gone or its queue full: its request ends anyway
            log.warning("client %r unreachable (%s); dropping %s", client[:8], exc, kind.name)

    def _error(self, client: bytes, request_id: str | None, code: str, message: str) -> None:
        self._reply(client, MsgType.ERROR, {"request_id": request_id, "code": code, "message": message})

    def _on_client_frames(self, frames: list) -> None:
        client = frames[0].bytes
        payload: Any = None
        try:
            msg_type, payload = decode(frames[1:])
            kind = validate(msg_type, payload, CLIENT_TO_COORDINATOR)
        except (WireError, ProtocolError) as exc:
            rid = payload.get("request_id") if isinstance(payload, dict) else None
            self._error(client, rid if isinstance(rid, str) else None, ErrorCode.BAD_MESSAGE, str(exc))
            return
        if kind is MsgType.GENERATE:
            self._on_generate(client, payload)
        elif kind is MsgType.ABORT:
            self._on_abort(client, str(payload["request_id"]))
        elif kind is MsgType.STATUS:
            self._reply(client, MsgType.STATUS_REPLY, self.status())

    def _on_generate(self, client: bytes, payload: dict[str, Any]) -> None:
        rid_in = payload.get("request_id")
        try:
            admitted = admit(self.builder, self.limits, payload)
        except Exception as exc:
            if not isinstance(exc, AdmissionError):
                log.exception("%s: admission failed unexpectedly", rid_in)
                self._error(client, rid_in if isinstance(rid_in, str) else None, ErrorCode.INTERNAL,
                            f"admission failed: {exc.__class__.__name__}: {exc}")
                return
            self.stats["rejected"] += 1
            log.info("%s rejected: %s", rid_in, exc)
            self._error(client, rid_in if isinstance(rid_in, str) else None, ErrorCode.BAD_REQUEST, str(exc))
            return
        key = (client, admitted.request.request_id)
        if key in self.by_client:
            self._error(client, admitted.request.request_id, ErrorCode.BAD_REQUEST,
                        f"request_id {admitted.request.request_id!r} is already in flight for this client")
            return
        st = RequestState(rid=uuid.uuid4().hex, client=client, admitted=admitted, arrived=time.monotonic())
        self.requests[st.rid] = st
        self.by_client[key] = st.rid
        self.stats["admitted"] += 1
        log.info("%s admitted: %d prompt tokens (%d visual, %d images), max_tokens %d", st.client_rid,
                 len(admitted.prompt_ids), admitted.visual_tokens, len(admitted.images),
                 admitted.request.sampling.max_tokens)
        self._restart(st, first=True)

    def _on_abort(self, client: bytes, request_id: str) -> None:
        rid = self.by_client.get((client, request_id))
        if rid is None:
            return
        st = self.requests[rid]
        self._cancel_on_worker(st)
        self._end(st, error=(ErrorCode.ABORTED, "aborted by the client"))

    # -- stages ----------------------------------------------------------------------------------------
    def _restart(self, st: RequestState, first: bool = False, reason: str = "") -> None:
        """(Re)run a request from its first stage, keeping the tokens the client already has."""
        if not first:
            self.stats["reruns"] += 1
            if st.attempt + 1 >= self.settings.max_attempts:
                self._end(st, error=(ErrorCode.INTERNAL, f"gave up after {st.attempt + 1} attempts: {reason}"))
                return
            log.warning("%s re-run (attempt %d): %s", st.client_rid, st.attempt + 2, reason)
        if not first:
            self._cancel_on_worker(st)  # the stage may still be running on a live worker
        st.attempt += 0 if first else 1
        st.deadline = 0.0
        st.embeddings = st.kv = st.embeddings_from = st.kv_from = None
        st.next_stage = "start"
        self._advance(st)

    def _advance(self, st: RequestState) -> None:
        """Dispatch the request's next stage, or park it until a worker of that role is up."""
        now = time.monotonic()
        if st.next_stage == "start":
            route = pipeline_for(self.workers.values(), st.has_images)
            if route is None:
                return self._park(st)
            st.next_stage = "run" if route == "unified" else ("encode" if st.has_images else "prefill")
        if st.stage == "queued" and st.timings["queue_s"] == 0.0:
            st.timings["queue_s"] = now - st.arrived
        worker = self._route(st)
        if worker is None:
            return self._park(st)
        stage = st.next_stage
        kind, payload, tokens = self._stage_message(st, stage)
        st.stage, st.worker_id, st.stage_started = stage, worker.worker_id, now
        st.deadline = now + self.settings.stage_timeout_s
        self._charge(st, worker, tokens)
        self._to_worker(worker.worker_id, kind, payload)

    def _park(self, st: RequestState) -> None:
        if st.stage != "queued" or st.deadline == 0.0:  # newly parked: a full stage timeout to find a worker
            st.deadline = time.monotonic() + self.settings.stage_timeout_s
        st.stage = "queued"
        if st.rid not in self.pending:
            self.pending.append(st.rid)

    def _route(self, st: RequestState) -> WorkerView | None:
        ws = self.workers.values()
        a = st.admitted
        if st.next_stage == "run":
            return route_unified(ws)
        if st.next_stage == "encode":
            hashes = [im.hash for im in a.images]
            return route_encode(ws, hashes, self._holders(hashes))
        if st.next_stage == "prefill":
            return route_prefill(ws, len(a.prompt_ids), self._prefix_hits(a), self.block_size)
        if st.next_stage == "decode":
            need = -(-(len(a.prompt_ids) + a.request.sampling.max_tokens) // self.block_size)
            return route_decode(ws, need)
        raise AssertionError(st.next_stage)

    def _stage_message(self, st: RequestState, stage: str) -> tuple[MsgType, dict[str, Any], int]:
        a = st.admitted
        common = {"request_id": st.rid, "attempt": st.attempt}
        sampling = a.request.sampling.model_dump()
        if stage == "encode":
            return MsgType.ENCODE, {**common, "images": [{"hash": im.hash, "data": im.data} for im in a.images]}, 0
        if stage == "prefill":
            return MsgType.PREFILL, {**common, "prompt_ids": a.prompt_ids, "output_ids": st.output_ids,
                                     "image_hashes": [im.hash for im in a.images], "embeddings": st.embeddings,
                                     "grids": st.image_grids, "sampling": sampling,
                                     "priority": a.request.priority}, len(a.prompt_ids)
        if stage == "decode":
            return MsgType.DECODE, {**common, **st.kv}, 0
        return MsgType.RUN, {**common, "prompt_ids": a.prompt_ids, "output_ids": st.output_ids,
                             "images": [{"hash": im.hash, "data": im.data} for im in a.images],
                             "sampling": sampling, "priority": a.request.priority}, len(a.prompt_ids)

    def _holders(self, hashes: list[str]) -> dict[str, set[str]]:
        holders = {h: set(self.embedding_holders.get(h, ())) for h in hashes}
        if self.store is not None and self.store.healthy:
            for h in hashes:
                holders[h] |= self.store.lookup_embedding(self.model_name, h)
        return holders

    def _prefix_hits(self, admitted: Admitted) -> dict[str, int]:
        ids = admitted.prompt_ids
        if self.store is None or not self.store.healthy or len(ids) < 2 * self.block_size:
            return {}
        # Same keys as the workers' block hashes: each image's hash and offset, not just its placeholder ids.
        spans = [ImageSpan(start, n, im.hash)
                 for (start, n), im in zip(self.builder.family.image_spans(ids), admitted.images)]
        return self.store.match_prefix(self.model_name, prompt_block_hashes(ids, self.block_size, spans)[:64])

    def _charge(self, st: RequestState, worker: WorkerView, tokens: int) -> None:
        self._uncharge(st)
        worker.inflight += 1
        worker.inflight_tokens += tokens
        st.charged = (worker.worker_id, tokens)

    def _uncharge(self, st: RequestState) -> None:
        if st.charged:
            w = self.workers.get(st.charged[0])
            if w is not None:
                w.inflight = max(0, w.inflight - 1)
                w.inflight_tokens = max(0, w.inflight_tokens - st.charged[1])
            st.charged = None

    def _stage_done(self, st: RequestState, timing_key: str) -> None:
        st.timings[timing_key] += time.monotonic() - st.stage_started
        self._uncharge(st)

    # -- workers ----------------------------------------------------------------------------------------
    def _to_worker(self, worker_id: str, kind: MsgType, payload: dict[str, Any]) -> None:
        try:
            send(self.worker_sock, kind, body(**payload), identity=worker_id.encode(), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the worker's socket is gone
            self._worker_died(worker_id, f"unreachable ({exc})")

    def _on_worker_frames(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg_type, payload = decode(frames[1:])
            kind = validate(msg_type, payload, WORKER_TO_COORDINATOR)
        except (WireError, ProtocolError) as exc:
            log.error("dropped a bad message from worker %r: %s", identity[:32], exc)
            return
        worker_id = identity.decode(errors="replace")
        if kind is MsgType.READY:
            return self._on_ready(worker_id, payload)
        known = self.workers.get(worker_id)
        if kind is MsgType.HEARTBEAT and "role" in payload and (known is None or not known.alive):
            # A worker this coordinator never met (it restarted) or declared dead (it stalled): its
            # heartbeat carries its registration, so it rejoins without a restart of its own.
            return self._on_ready(worker_id, payload)
        if known is None:
            log.warning("message %s from unregistered worker %s ignored", kind.name, worker_id)
            return
        self.last_seen[worker_id] = time.monotonic()
        if kind is MsgType.HEARTBEAT:
            self._apply_load(worker_id, payload["load"])
        elif kind is MsgType.ENCODED:
            self._on_encoded(worker_id, payload)
        elif kind is MsgType.PREFILLED:
            self._on_prefilled(worker_id, payload)
        elif kind is MsgType.STEP_TOKENS:
            for item in payload["items"]:
                self._on_step_tokens(worker_id, item)
        elif kind is MsgType.FAILED:
            self._on_failed(worker_id, payload)
        elif kind is MsgType.BYE:
            self._worker_died(worker_id, "said goodbye")

    def _on_ready(self, worker_id: str, payload: dict[str, Any]) -> None:
        role = payload["role"]
        if role not in ROLES:
            log.error("worker %s announced unknown role %r; ignored", worker_id, role)
            return
        was_alive = worker_id in self.workers and self.workers[worker_id].alive
        if was_alive:  # a restarted process with the same id: its old work is lost
            self._worker_died(worker_id, "re-registered")
        self.workers[worker_id] = WorkerView(worker_id, role)
        for rid in self.abandoned.pop(worker_id, ()):  # it was only stalled: stop its stale work
            self._to_worker(worker_id, MsgType.CANCEL, {"request_id": rid})
        self.worker_info[worker_id] = dict(payload)
        self.last_seen[worker_id] = time.monotonic()
        self.block_size = int(payload.get("block_size") or self.block_size)
        self._apply_load(worker_id, payload.get("load") or {})
        log.info("worker %s joined as %s (data plane %s)", worker_id, role, payload["data_address"])
        self._retry_pending()

    def _apply_load(self, worker_id: str, load: dict[str, Any]) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        for key in ("queue_len", "running", "free_blocks", "total_blocks"):
            if key in load:
                setattr(w, key, int(load[key]))
        if "tokens_per_s" in load:
            w.tokens_per_s = float(load["tokens_per_s"])

    def _current(self, worker_id: str, payload: dict[str, Any], stage: str) -> RequestState | None:
        """The request a worker reply is about, if that reply is still the live attempt of that stage."""
        st = self.requests.get(str(payload.get("request_id")))
        if st is None or st.attempt != payload.get("attempt") or st.stage != stage or st.worker_id != worker_id:
            return None  # stale: an earlier attempt, a re-routed stage, or an aborted request
        return st

    def _on_encoded(self, worker_id: str, payload: dict[str, Any]) -> None:
        st = self._current(worker_id, payload, "encode")
        for im in payload["images"]:
            self.embedding_holders.setdefault(im["hash"], set()).add(worker_id)
        if st is None:
            return
        self._stage_done(st, "encode_s")
        st.timings["worker_s"] += float(payload.get("worker_s", 0.0))
        st.embeddings, st.embeddings_from = payload["descriptor"], worker_id
        st.image_grids = [im.get("grid") for im in payload["images"]]
        st.cache_hits["embedding"] += int(payload.get("cache_hits", 0))
        st.next_stage = "prefill"
        self._advance(st)

    def _on_prefilled(self, worker_id: str, payload: dict[str, Any]) -> None:
        st = self._current(worker_id, payload, "prefill")
        if st is None:
            return
        self._stage_done(st, "prefill_s")
        st.timings["transfer_s"] += float(payload.get("fetch_s", 0.0))
        st.timings["worker_s"] += float(payload.get("worker_s", 0.0))
        st.cache_hits["prefix_tokens"] += int(payload.get("cached_tokens", 0))
        self._emit(st, [int(payload["token_id"])])
        if payload["finish_reason"] != "prefilled":
            return self._end(st, finish_reason=payload["finish_reason"])
        st.kv, st.kv_from = {"descriptor": payload["descriptor"], "state": payload["state"]}, worker_id
        st.next_stage = "decode"
        self._advance(st)

    def _on_step_tokens(self, worker_id: str, item: dict[str, Any]) -> None:
        stage = "run" if self.workers[worker_id].role == "unified" else "decode"
        st = self._current(worker_id, item, stage)
        if st is None:
            return
        st.timings["transfer_s"] += float(item.get("fetch_s", 0.0))
        now = time.monotonic()
        st.deadline = now + self.settings.stage_timeout_s  # progress resets the stage timeout
        if stage == "run" and item.get("first"):  # unified: time to the first token is its prefill
            st.timings["prefill_s"] += now - st.stage_started
            st.stage_started = now
        self._emit(st, [int(t) for t in item["token_ids"]])
        if item.get("finished"):
            st.timings["worker_s"] += float(item.get("worker_s", 0.0))
            self._stage_done(st, "decode_s")
            st.cache_hits["prefix_tokens"] += int(item.get("cached_tokens", 0))
            self._end(st, finish_reason=item.get("finish_reason") or "stop")

    def _on_failed(self, worker_id: str, payload: dict[str, Any]) -> None:
        st = self.requests.get(str(payload.get("request_id")))
        if st is None or st.attempt != payload.get("attempt") or st.worker_id != worker_id:
            return
        self._uncharge(st)
        if payload.get("retryable", True):
            self._restart(st, reason=f"{worker_id}: {payload['message']}")
        else:
            self._end(st, error=(ErrorCode.BAD_REQUEST, payload["message"]))

    def _worker_died(self, worker_id: str, why: str) -> None:
        w = self.workers.get(worker_id)
        if w is None or not w.alive:
            return
        w.alive = False
        log.warning("worker %s (%s) is gone: %s", worker_id, w.role, why)
        for holders in self.embedding_holders.values():
            holders.discard(worker_id)
        for st in list(self.requests.values()):
            lost = st.worker_id == worker_id and st.stage in ACTIVE_STAGES
            # Data parked on the dead worker (embeddings, prefilled KV) is gone too.
            lost |= st.embeddings_from == worker_id and st.stage in ("queued", "prefill") and st.embeddings is not None
            lost |= st.kv_from == worker_id and st.stage == "queued" and st.kv is not None
            if lost:
                if st.worker_id == worker_id:
                    self.abandoned.setdefault(worker_id, set()).add(st.rid)
                self._uncharge(st)
                self._restart(st, reason=f"worker {worker_id} {why}")

    # -- results ----------------------------------------------------------------------------------------
    def _emit(self, st: RequestState, tokens: list[int]) -> None:
        index = len(st.output_ids)
        st.output_ids.extend(tokens)
        if st.admitted.request.stream:
            self._reply(st.client, MsgType.TOKENS, {"request_id": st.client_rid, "index": index, "token_ids": tokens})

    def _end(self, st: RequestState, *, finish_reason: str | None = None, error: tuple[str, str] | None = None) -> None:
        self._uncharge(st)
        self.requests.pop(st.rid, None)
        self.by_client.pop((st.client, st.client_rid), None)
        if error is not None:
            self.stats["failed"] += 1
            log.warning("%s failed: %s", st.client_rid, error[1])
            return self._error(st.client, st.client_rid, *error)
        self.stats["completed"] += 1
        total = time.monotonic() - st.arrived
        timings = {**{k: round(v, 6) for k, v in st.timings.items()}, "total_s": round(total, 6)}
        log.info("%s done: %d tokens (%s) in %.0f ms", st.client_rid, len(st.output_ids), finish_reason, total * 1e3)
        self._reply(st.client, MsgType.RESULT, {
            "request_id": st.client_rid, "token_ids": st.output_ids, "text": self.builder.decode(st.output_ids),
            "finish_reason": finish_reason, "prompt_tokens": len(st.admitted.prompt_ids),
            "visual_tokens": st.admitted.visual_tokens, "timings": timings, "cache_hits": st.cache_hits,
            "attempts": st.attempt + 1})

    def _cancel_on_worker(self, st: RequestState) -> None:
        w = self.workers.get(st.worker_id or "")
        if w is not None and w.alive and st.stage in ACTIVE_STAGES:
            self._to_worker(w.worker_id, MsgType.CANCEL, {"request_id": st.rid})

    # -- housekeeping -------------------------------------------------------------------------------------
    def _retry_pending(self) -> None:
        for _ in range(len(self.pending)):
            rid = self.pending.popleft()
            st = self.requests.get(rid)
            if st is not None and st.stage == "queued":
                self._advance(st)

    def _tick(self, now: float) -> None:
        for worker_id, seen in list(self.last_seen.items()):
            if self.workers[worker_id].alive and now - seen > self.settings.dead_after_s:
                self._worker_died(worker_id, f"no heartbeat for {now - seen:.1f}s")
        for st in list(self.requests.values()):
            if now > st.deadline > 0:
                if st.stage == "queued":
                    self._end(st, error=(ErrorCode.NO_WORKERS, f"no worker could take the request's {st.next_stage} "
                                                               f"stage within {self.settings.stage_timeout_s}s"))
                else:
                    self._uncharge(st)
                    self._restart(st, reason=f"{st.stage} stage timed out on {st.worker_id}")
        if self.pending:
            self._retry_pending()
        if self.store is not None and now >= self._next_redis_sync:
            self._next_redis_sync = now + 0.25
            self._sync_loads_from_redis()

    def _sync_loads_from_redis(self) -> None:
        loads = self.store.get_loads([w for w, v in self.workers.items() if v.alive])
        for worker_id, load in loads.items():
            self._apply_load(worker_id, load)

    def status(self) -> dict[str, Any]:
        roles: dict[str, int] = {}
        for w in self.workers.values():
            if w.alive:
                roles[w.role] = roles.get(w.role, 0) + 1
        return {"workers": {wid: {"role": w.role, "alive": w.alive, "load": {
                    "queue_len": w.queue_len, "running": w.running, "free_blocks": w.free_blocks,
                    "total_blocks": w.total_blocks, "tokens_per_s": w.tokens_per_s, "inflight": w.inflight}}
                            for wid, w in self.workers.items()},
                "roles": roles, "model": self.model_name, "requests_in_flight": len(self.requests),
                "redis_healthy": bool(self.store and self.store.healthy), "stats": dict(self.stats)}
