"""Client API: speaks GENERATE / ABORT / STATUS to the coordinator's client ROUTER and assembles replies.

Two flavours over one wire protocol (common/protocol.py):

* ``Client`` is synchronous: one request in flight at a time over one DEALER socket that every call
  reuses. It is NOT thread-safe; give each thread its own ``Client``.
* ``AsyncClient`` is asyncio: any number of concurrent ``generate()`` / ``stream()`` calls share one
  DEALER socket, and a single reader task routes replies by request_id to per-request queues.

``stream()`` returns a ``TokenStream`` (``AsyncTokenStream``): iterate it for token ids as TOKENS
arrive; once it is exhausted, ``.result`` holds the same ``GenerateResult`` that ``generate()``
returns. Stopping early (``close()``, leaving a ``with`` block, or dropping the stream) sends ABORT.
Every timeout is a deadline for the whole request; when it passes, ABORT is sent and
``RequestTimeout`` raised. Replies that arrive for a request the client gave up on are dropped.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Sequence

import zmq

from mserve.common import protocol
from mserve.common.prompt import image_bytes_from_part
from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.serde import WireError
from mserve.common.sockets import make_socket, recv, send

logger = logging.getLogger(__name__)

__all__ = [
    "MServeError", "BadRequest", "Overloaded", "NoWorkers", "RequestTimeout", "Aborted", "ServerError",
    "GenerateResult", "normalize_client_messages", "error_from_reply", "Client", "AsyncClient",
    "TokenStream", "AsyncTokenStream",
]


# --------------------------------------------------------------------------- errors and results


class MServeError(Exception):
    """An ERROR reply (or a client-side failure of the same kind); branch on ``code``."""

    default_code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: str | None = None, request_id: str | None = None) -> None:
        self.code = code or self.default_code
        self.message = message
        self.request_id = request_id
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{self.code}: {message}{where}")


class BadRequest(MServeError):
    default_code = ErrorCode.BAD_REQUEST


class Overloaded(MServeError):
    default_code = ErrorCode.OVERLOADED


class NoWorkers(MServeError):
    default_code = ErrorCode.NO_WORKERS


class RequestTimeout(MServeError):
    default_code = ErrorCode.TIMEOUT


class Aborted(MServeError):
    default_code = ErrorCode.ABORTED


class ServerError(MServeError):
    default_code = ErrorCode.INTERNAL


_ERRORS_BY_CODE: dict[str, type[MServeError]] = {
    ErrorCode.BAD_REQUEST: BadRequest, ErrorCode.BAD_MESSAGE: BadRequest, ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.NO_WORKERS: NoWorkers, ErrorCode.TIMEOUT: RequestTimeout, ErrorCode.ABORTED: Aborted,
    ErrorCode.INTERNAL: ServerError,
}


def error_from_reply(body: dict[str, Any]) -> MServeError:
    """The exception for an ERROR body; unknown codes (newer servers) become ServerError, code kept."""
    code = str(body.get("code") or ErrorCode.INTERNAL)
    cls = _ERRORS_BY_CODE.get(code, ServerError)
    return cls(str(body.get("message", "")), code=code, request_id=body.get("request_id"))


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    visual_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, encode_s, ..., total_s
    cache_hits: dict[str, int] = field(default_factory=dict)  # embedding, prefix_tokens
    attempts: int = 1

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> GenerateResult:
        return cls(request_id=body["request_id"], token_ids=list(body["token_ids"]), text=body["text"],
                   finish_reason=body["finish_reason"], prompt_tokens=body.get("prompt_tokens") or 0,
                   visual_tokens=body.get("visual_tokens") or 0, timings=dict(body.get("timings") or {}),
                   cache_hits=dict(body.get("cache_hits") or {}), attempts=body.get("attempts") or 1)


# --------------------------------------------------------------------------- request building


def normalize_client_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages with every image part turned into ``{"type": "image", "image": bytes}``.

    Image parts may hold bytes, a file path (str or Path), a data URL, or be OpenAI's
    ``{"type": "image_url", "image_url": {"url": ...}}``. The server refuses paths (they name files on
    the client's disk), so they are read here. The input is not modified.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        content = msg.get("content")
        if isinstance(content, str):
            out.append(dict(msg))
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(dict(part))
            elif kind in ("image", "image_url"):
                if isinstance(part.get("image"), PurePath):  # image_bytes_from_part takes str paths
                    part = {**part, "image": str(part["image"])}
                try:
                    parts.append({"type": "image", "image": image_bytes_from_part(part)})
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].content[{j}]: {exc}") from None
            else:
                raise ValueError(f"messages[{i}].content[{j}] has an unsupported part type {kind!r} "
                                 "(expected 'text', 'image' or 'image_url')")
        out.append({**msg, "content": parts})
    return out


def _generate_body(request_id: str, messages: Sequence[dict[str, Any]], stream: bool, *, max_tokens: int = 64,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                   stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, priority: int = 0,
                   latency_class: str = "interactive") -> dict[str, Any]:
    sampling = {"max_tokens": int(max_tokens), "temperature": float(temperature), "top_k": int(top_k),
                "top_p": float(top_p), "seed": None if seed is None else int(seed),
                "stop_token_ids": [int(t) for t in stop_token_ids], "ignore_eos": bool(ignore_eos)}
    return protocol.body(request_id=request_id, messages=normalize_client_messages(messages), sampling=sampling,
                         priority=int(priority), latency_class=latency_class, stream=stream)


def _new_request_id(request_id: str | None) -> str:
    return request_id if request_id is not None else uuid.uuid4().hex


def _new_identity() -> bytes:
    return b"client-" + uuid.uuid4().hex[:16].encode()


class _Assembler:
    """Folds one request's TOKENS / RESULT / ERROR replies into tokens ready to hand out."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.ready: deque[int] = deque()
        self.num_received = 0
        self.result: GenerateResult | None = None
        self.finished = False  # the server ended the request (RESULT or ERROR)

    def feed(self, kind: int, body: dict[str, Any]) -> None:
        if kind == MsgType.ERROR:
            self.finished = True
            raise error_from_reply({**body, "request_id": body.get("request_id") or self.request_id})
        if kind == MsgType.TOKENS:
            index, tokens = int(body["index"]), list(body["token_ids"])
            if index > self.num_received:
                # A gap means tokens were lost; the output would be silently wrong, so fail loudly.
                raise ServerError(f"token stream gap: expected index {self.num_received}, got {index}",
                                  request_id=self.request_id)
            fresh = tokens[self.num_received - index:]  # a retried attempt may resend tokens we have
            self.ready.extend(fresh)
            self.num_received += len(fresh)
        elif kind == MsgType.RESULT:
            self.result = GenerateResult.from_body(body)
            # RESULT carries the whole output: hand out any tail that no TOKENS chunk carried.
            tail = self.result.token_ids[self.num_received:]
            self.ready.extend(tail)
            self.num_received += len(tail)
            self.finished = True


# --------------------------------------------------------------------------- sync client


class Client:
    """Synchronous client over one DEALER socket; one request at a time, not thread-safe."""

    def __init__(self, address: str, *, timeout_s: float = 120.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=address, identity=_new_identity())
        # Weak, so a stream the caller dropped mid-way is finalized (ABORT sent) instead of pinned here.
        self._active: weakref.ref[TokenStream] | None = None
        self._closed = False

    def generate(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
                 request_id: str | None = None, **sampling: Any) -> GenerateResult:
        """Send one request and wait for its result. ``sampling``: max_tokens=64, temperature=0.0, top_k=0,
        top_p=1.0, seed=None, stop_token_ids=(), ignore_eos=False, priority=0, latency_class="interactive"."""
        with self._start(messages, False, timeout_s, request_id, sampling) as s:
            for _ in s:
                pass
        assert s.result is not None
        return s.result

    def stream(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
               request_id: str | None = None, **sampling: Any) -> TokenStream:
        """Like generate(), but yields token ids as they arrive; ``.result`` is set once exhausted."""
        return self._start(messages, True, timeout_s, request_id, sampling)

    def _start(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None,
               request_id: str | None, sampling: dict[str, Any]) -> TokenStream:
        self._check_idle()
        rid = _new_request_id(request_id)
        payload = _generate_body(rid, messages, stream, **sampling)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._send(MsgType.GENERATE, payload, time.monotonic() + timeout, rid)
        stream = TokenStream(self, rid, time.monotonic() + timeout, timeout)
        self._active = weakref.ref(stream)
        return stream

    def _check_idle(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        active = self._active() if self._active is not None else None
        if active is not None and not active.done:  # its replies would be read, and lost, by this call
            raise RuntimeError("a stream is still open on this Client: exhaust or close() it first "
                               "(or use AsyncClient for concurrent requests)")

    def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The coordinator's STATUS_REPLY body: workers, roles, model, redis_healthy."""
        self._check_idle()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self._send(MsgType.STATUS, protocol.body(), deadline, None)
        while (reply := self._recv(deadline)) is not None:
            if reply[0] == MsgType.STATUS_REPLY:
                return reply[1]
        raise RequestTimeout(f"no STATUS reply from {self.address} within the deadline")

    def abort(self, request_id: str) -> None:
        """Ask the coordinator to drop a request (best effort, no reply is awaited)."""
        if not self._closed:
            _send_abort(self._sock, request_id)

    def close(self) -> None:
        if self._closed:
            return
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, kind: MsgType, payload: dict[str, Any], deadline: float, request_id: str | None) -> None:
        # IMMEDIATE makes a send block while the coordinator is unreachable; bound it by the deadline.
        while True:
            try:
                send(self._sock, kind, payload, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not self._sock.poll(remaining_ms, zmq.POLLOUT):
                    raise RequestTimeout(f"coordinator at {self.address} is not reachable",
                                         request_id=request_id) from None

    def _recv(self, deadline: float) -> tuple[MsgType, dict[str, Any]] | None:
        """The next valid reply, or None once the deadline passes."""
        while (remaining_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not self._sock.poll(remaining_ms, zmq.POLLIN):
                return None
            reply = _recv_valid(self._sock)
            if reply is not None:
                return reply
        return None

    def _next_reply(self, request_id: str, deadline: float) -> tuple[MsgType, dict[str, Any]] | None:
        while (reply := self._recv(deadline)) is not None:
            kind, payload = reply
            rid = payload.get("request_id")
            # A null-id ERROR answers a message the server could not decode: with one request in
            # flight, that is this one.
            if rid == request_id or (kind == MsgType.ERROR and rid is None):
                return reply
            logger.debug("%s dropping stale %s", rid, kind.name)
        return None


class _StreamState:
    """What the sync and async token streams share: the assembled result and whether they are done."""

    _asm: _Assembler
    _closed: bool

    @property
    def result(self) -> GenerateResult | None:
        return self._asm.result

    @property
    def done(self) -> bool:
        return self._closed or self._asm.finished


class TokenStream(_StreamState):
    """Iterator of token ids for one request of a sync Client; ``.result`` once exhausted."""

    def __init__(self, client: Client, request_id: str, deadline: float, timeout_s: float) -> None:
        self.request_id = request_id
        self._client = client
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._asm = _Assembler(request_id)
        self._closed = False

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._asm.ready:
            if self.done:
                raise StopIteration
            reply = self._client._next_reply(self.request_id, self._deadline)
            if reply is None:
                self.close()
                raise RequestTimeout(f"no result within {self._timeout_s}s; request aborted",
                                     request_id=self.request_id)
            try:
                self._asm.feed(*reply)
            except MServeError:
                self.close()
                raise
        return self._asm.ready.popleft()

    def close(self) -> None:
        """Stop early: sends ABORT unless the server already finished the request."""
        if not self.done and not self._client._closed:
            _send_abort(self._client._sock, self.request_id)
        self._closed = True

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: sockets may already be gone
            pass


def _send_abort(sock: zmq.Socket, request_id: str) -> None:
    try:
        send(sock, MsgType.ABORT, protocol.body(request_id=request_id), flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # zmq.Again included: no coordinator connected, nothing to abort there
        logger.debug("%s ABORT not sent: %s", request_id, exc)


def _recv_valid(sock: zmq.Socket, flags: int = 0) -> tuple[MsgType, dict[str, Any]] | None:
    """One reply, or None for a malformed one (logged and dropped: it cannot be attributed)."""
    try:
        _, kind, payload = recv(sock, flags=flags)
        return protocol.validate(kind, payload, protocol.COORDINATOR_TO_CLIENT), payload
    except (WireError, protocol.ProtocolError) as exc:
        logger.warning("dropping malformed reply from coordinator: %s", exc)
        return None


# The asyncio flavour lives in its own module; importing it here keeps one public entry point.
from mserve.coordinator.async_client import AsyncClient, AsyncTokenStream  # noqa: E402
