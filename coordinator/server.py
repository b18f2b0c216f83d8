"""The coordinator: admits client requests and walks each one through encode -> prefill -> decode.

One thread, one poll loop over two ROUTER sockets (clients, workers). This module is the socket
side only: it decodes and validates frames, admits GENERATE requests (tokenizing, with the requested
model's tokenizer), feeds everything to that model's request state machine (coordinator/requests.py;
coordinator/models.py keeps one per served model) with the current time, and sends what the
machine answers. Tensors move worker-to-worker, never through here; a worker that cannot be reached
is reported back to the machine, which re-runs its requests elsewhere.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any

import zmq

from mserve.common import pruning
from mserve.common.policy import LATENCY_CLASSES
from mserve.common.perf import freeze_startup_heap, resident_mib
from mserve.common.protocol import ErrorCode, Message, MsgType, ProtocolError, check_header, parse_message
from mserve.common.protocol.client import FROM_CLIENT, Error, Signed, Status, StatusReply
from mserve.common.protocol.to_coordinator import TO_COORDINATOR, Heartbeat, registration_of
from mserve.common.protocol.to_worker import SwitchRole
from mserve.common.security import CurveKeys, Gate, check_curve_settings
from mserve.common.shards import advertised
from mserve.common.serde import WireError, decode
from mserve.common.sockets import make_socket, send
from mserve.coordinator.adaptive_pruning import AdaptivePruning
from mserve.coordinator.coordinator_redis import CoordinatorRedis, RedisEncodeLeases, RedisLookups
from mserve.coordinator.admission import AdmissionError, Limits, admit
from mserve.coordinator.events import Abort, FromWorker, Reject, Submit, SwitchRoleTo, Tick, Unreachable
from mserve.coordinator.models import ModelTable, ModelUnavailable, ServedModel, VariantRouter, merged_status
from mserve.coordinator.requests import Out, RequestMachine, ToClient
from mserve.coordinator.settings import CoordinatorSettings

log = logging.getLogger("mserve.coordinator")
# What a client may send: FROM_CLIENT, and an operator's SWITCH_ROLE (`mserve switch-role`).
CLIENT_MESSAGES = {**FROM_CLIENT, SwitchRole.KIND: SwitchRole}


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        # The default model: requests that name none go to it (None: workers bring every model).
        self.model_name = (settings.model_name or settings.model) if settings.model else None
        self.limits = Limits(**settings.limits())
        self.ctx = zmq.Context.instance()
        key = settings.client_api_key
        self._client_key = key.get_secret_value().encode() if key is not None else None
        self._unauthorized = 0  # client messages refused for a missing or wrong api_key
        self._next_unauthorized_log = 0.0
        self._gate = None  # CURVE on the worker link: workers whose keys are not authorized are refused
        if check_curve_settings("coordinator", curve_secret_key=settings.curve_secret_key,
                                curve_authorized_keys=settings.curve_authorized_keys):
            keys = CurveKeys.from_files(settings.curve_secret_key, authorized_keys=settings.curve_authorized_keys)
            self._gate = Gate(self.ctx, keys, "coordinator worker link")
        self.client_sock = make_socket(self.ctx, zmq.ROUTER, bind=settings.bind)
        self.worker_sock = make_socket(self.ctx, zmq.ROUTER, bind=settings.worker_bind,
                                       curve=self._gate.apply if self._gate else None)
        # Announcement, loads poll, cache hints, encode leases; the loop never waits on Redis for them
        # (coordinator/coordinator_redis.py).
        self.shard_id = settings.shard_id
        self.redis = CoordinatorRedis(settings.redis, timeout_s=settings.redis_timeout_s, shard_id=self.shard_id,
                                      load_poll_s=settings.load_poll_s) if settings.redis else None
        # A shard announces itself where workers and clients look for every shard (common/shards.py).
        self._announced = (advertised(settings.bind, settings.advertise, "--bind"),
                           advertised(settings.worker_bind, settings.worker_advertise, "--worker-bind")) \
            if self.redis is not None and self.redis.registry is not None else None
        self._started = time.time()
        self._shard_owner = self.shard_id or uuid.uuid4().hex
        routing = settings.variant_routing()
        self.models = ModelTable(self.model_name, settings.model, self._serve_model,
                                 VariantRouter(*routing) if routing is not None else None)
        self._running = True

    def _serve_model(self, name: str, path: str) -> ServedModel:
        """A model's tokenizer and request machine: its own pools, queues, caches (Redis keys per model)."""
        from mserve.common.prompt import PromptBuilder

        settings = self.settings
        builder = PromptBuilder(path, visual_token_pruning=settings.visual_token_pruning)
        machine = RequestMachine(
            settings, detokenize=builder.decode, shard_id=self._shard_owner,
            encode_leases=RedisEncodeLeases(self.redis.store, name, self.redis.lane) if self.redis else None,
            lookups=RedisLookups(self.redis.store, builder, name) if self.redis else None,
            adaptive_pruning=self._adaptive_pruning(settings, builder) if name == self.model_name else None)
        return ServedModel(name, path, builder, machine)

    def _adaptive_pruning(self, settings: CoordinatorSettings, builder: Any) -> AdaptivePruning | None:
        """SLO-adaptive pruning of the --model when configured (PruningError at start-up for a family that
        cannot prune). Models that join with their workers run without it."""
        objectives = settings.pruning_objectives()
        if not objectives:
            return None
        if (why := pruning.unsupported(builder.family)) is not None:
            raise pruning.PruningError(f"--adaptive-pruning (adaptive_pruning): {why}")
        log.info("SLO-adaptive visual-token pruning on: %s", ", ".join(
            f"{c}: keep {o.max_keep_ratio:g} while predicted TTFT > {o.ttft_s * 1000:g} ms" for c, o in objectives.items()))
        return AdaptivePruning(objectives, configured=settings.visual_token_pruning)

    # -- loop --------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        freeze_startup_heap()
        poller = zmq.Poller()
        poller.register(self.client_sock, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        log.info("coordinator ready: clients %s, workers %s, model %s (others join with their workers)",
                 self.settings.bind, self.settings.worker_bind, self.model_name)
        if self.shard_id:
            log.info("coordinator shard %r: %s", self.shard_id,
                     f"announced in Redis as clients {self._announced[0]}, workers {self._announced[1]}"
                     if self._announced else "not announced (no --redis): workers and clients must list it")
        log.info("client link: %s; worker link: %s",
                 "API key required" if self._client_key else "no API key (unauthenticated)",
                 f"CURVE, authorized keys in {self.settings.curve_authorized_keys}" if self._gate
                 else "no CURVE (unauthenticated, plaintext)")
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
        if self.redis is not None:
            self.redis.close()
        self.client_sock.close(0)
        self.worker_sock.close(0)
        if self._gate:
            self._gate.close()

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

    # -- sending what the machine answers -----------------------------------------------------------------
    def _send(self, out: list[Out]) -> None:
        for msg in out:
            if isinstance(msg, ToClient):
                self._reply(msg.identity, msg.kind, msg.msg)
                continue
            try:
                send(self.worker_sock, msg.kind, msg.msg.to_body(), identity=msg.worker_id.encode(), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the worker's socket is gone
                model = self.models.of_worker(msg.worker_id)
                if model is not None:
                    self._send(model.machine.step(Unreachable(msg.worker_id, str(exc), getattr(msg.msg, "request_id", None)),
                                                   time.monotonic()))

    def _reply(self, client: bytes, kind: MsgType, msg: Message) -> None:
        try:
            send(self.client_sock, kind, msg.to_body(), identity=client, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # client gone or its queue full: its request ends anyway
            log.warning("client %r unreachable (%s); dropping %s", client[:8], exc, kind.name)

    def _error(self, client: bytes, request_id: str | None, code: str, message: str) -> None:
        self._reply(client, MsgType.ERROR, Error(request_id=request_id, code=code, message=message))

    # -- clients -------------------------------------------------------------------------------------
    def _on_client_frames(self, frames: list) -> None:
        client = frames[0].bytes
        payload: Any = None
        try:
            msg_type, payload = decode(frames[1:])
            kind = check_header(msg_type, payload, CLIENT_MESSAGES)
            key = Signed.take_api_key(payload)  # every client message is Signed
            # A GENERATE's content is parsed once, by admission (the outside world's input; its errors name
            # the field and limit); ABORT and STATUS here.
            msg = None if kind is MsgType.GENERATE else CLIENT_MESSAGES[kind].from_body(payload)
        except (WireError, ProtocolError) as exc:
            rid = payload.get("request_id") if isinstance(payload, dict) else None
            self._error(client, rid if isinstance(rid, str) else None, ErrorCode.BAD_MESSAGE, str(exc))
            return
        if self._client_key is not None and not (
                isinstance(key, str) and hmac.compare_digest(key.encode(), self._client_key)):
            self._refuse(client, kind, payload, "missing" if key is None else "wrong")
            return
        if kind is MsgType.GENERATE:
            self._on_generate(client, payload)
        elif kind is MsgType.ABORT:
            for model in self.models:  # a request id is the client's: whichever model holds it ends it
                self._send(model.machine.step(Abort(client, msg.request_id), time.monotonic()))
        elif isinstance(msg, SwitchRole):
            self._on_switch_role(client, msg)
        elif isinstance(msg, Status):
            if msg.request_ids is not None:  # a client's liveness probe: which of its requests are still here
                unknown = [r for r in msg.request_ids
                           if all(m.machine.unknown(client, [r]) for m in self.models)]
                self._reply(client, MsgType.STATUS_REPLY, StatusReply(workers={}, unknown_requests=unknown))
            else:
                report = self.status()
                self._reply(client, MsgType.STATUS_REPLY, StatusReply(workers=report.pop("workers"), report=report))

    def _on_switch_role(self, client: bytes, msg: SwitchRole) -> None:
        """An operator's role switch: started (the reply is the status, its `role_switching` showing it), or
        ERROR bad_request naming why not."""
        model = self.models.of_worker(msg.worker_id)
        why = f"worker_id {msg.worker_id!r}: no such worker" if model is None else \
            model.machine.switcher.refusal(msg.worker_id, msg.role)
        if why is not None:
            self._error(client, None, ErrorCode.BAD_REQUEST, why)
            return
        self._send(model.machine.step(SwitchRoleTo(msg.worker_id, msg.role, "operator"), time.monotonic()))
        report = self.status()
        self._reply(client, MsgType.STATUS_REPLY, StatusReply(workers=report.pop("workers"), report=report))

    def _refuse(self, client: bytes, kind: MsgType, payload: dict[str, Any], why: str) -> None:
        """ERROR unauthorized; the request is not admitted, counted or logged with its content."""
        self._unauthorized += 1
        now = time.monotonic()
        if now >= self._next_unauthorized_log:  # at most one line a second, whatever a client floods
            self._next_unauthorized_log = now + 1.0
            log.warning("refused %s from client %r: %s api_key (%d refused so far)", kind.name, client[:24], why,
                        self._unauthorized)
        rid = payload.get("request_id")
        self._error(client, rid if isinstance(rid, str) else None, ErrorCode.UNAUTHORIZED,
                    f"{why} api_key: this coordinator requires its client API key on every message "
                    "(Client/AsyncClient api_key= or MSERVE_CLIENT_API_KEY; the gateway: --coordinator-api-key)")

    def _on_generate(self, client: bytes, payload: dict[str, Any]) -> None:
        rid_in = payload.get("request_id")
        rid = rid_in if isinstance(rid_in, str) else None
        started = time.perf_counter()
        requested = payload.get("model")
        try:
            latency_class = payload.get("latency_class")
            model = self.models.serving(requested if isinstance(requested, str) and requested else None,
                                        latency_class if latency_class in LATENCY_CLASSES else "interactive",
                                        time.monotonic())
        except ModelUnavailable as exc:
            log.info("%s refused: %s", rid_in, exc)
            self._error(client, rid, exc.code, str(exc))
            return
        machine = model.machine
        if rid is not None and any(not m.machine.unknown(client, [rid]) for m in self.models if m is not model):
            # Request ids are the client's across models: its replies and ABORTs name no model.
            self._error(client, rid, ErrorCode.BAD_REQUEST, f"request_id {rid!r} is already in flight for this client")
            return
        try:
            adaptive = machine.adaptive
            admitted = admit(model.builder, self.limits, payload, adaptive.keep_ratio if adaptive else None)
            admitted.admission_s = time.perf_counter() - started
            admitted.model = model.name
        except AdmissionError as exc:
            self._send(machine.step(Reject(client, rid, str(exc), exc.code), time.monotonic()))
            return
        except Exception as exc:
            log.exception("%s: admission failed unexpectedly", rid_in)
            self._error(client, rid, ErrorCode.INTERNAL, f"admission failed: {exc.__class__.__name__}: {exc}")
            return
        self._send(machine.step(Submit(client, admitted), time.monotonic()))

    # -- workers ----------------------------------------------------------------------------------------
    def _on_worker_frames(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg_type, payload = decode(frames[1:])
            msg = parse_message(msg_type, payload, TO_COORDINATOR)
        except (WireError, ProtocolError) as exc:
            log.error("dropped a bad message from worker %r: %s", identity[:32], exc)
            return
        worker_id = identity.decode(errors="replace")
        model = self._model_for_worker(worker_id, msg)
        if model is None:
            log.warning("message %s from unregistered worker %s ignored", msg.KIND.name, worker_id)
            return
        self._send(model.machine.step(FromWorker(worker_id, msg.KIND, msg), time.monotonic()))

    def _model_for_worker(self, worker_id: str, msg: Message) -> ServedModel | None:
        """The model whose machine takes a worker's message: a READY (or a heartbeat carrying the
        registration) says which model, and joins it; anything else goes where the worker registered."""
        info = registration_of(msg)
        current = self.models.of_worker(worker_id)
        if info is None or (current is not None and isinstance(msg, Heartbeat)
                            and current.machine.members.is_alive(worker_id)):
            return current
        model = self.models.register(worker_id, info)
        if current is not None and model is not current:  # the same id, restarted for another model
            self._send(current.machine.step(Unreachable(worker_id, f"re-registered for model {info.model!r}"),
                                            time.monotonic()))
        return model

    # -- housekeeping -------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for model in self.models:
            self._send(model.machine.step(Tick(), now))
        if self.redis is not None:
            loads = self.redis.tick(now, self._announced, self._started,
                                    lambda: {model.name: model.machine.alive_workers() for model in self.models})
            for model in self.models:
                if loads and model.name in loads:
                    model.machine.apply_loads(loads[model.name])

    def status(self) -> dict[str, Any]:
        return {**merged_status(self.models, self.model_name), "shard_id": self.shard_id,
                "rss_mib": round(resident_mib(), 1),
                "redis_healthy": bool(self.redis and self.redis.store.responsive()), "unauthorized": self._unauthorized}
