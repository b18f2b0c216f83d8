"""Client API: speaks GENERATE / ABORT / STATUS to the coordinator's client ROUTER and assembles replies.

Two flavours over one wire protocol (common/protocol/), sharing client_core.py:

* ``Client`` is synchronous: one request in flight at a time over one DEALER socket (one per
  coordinator shard) that every call reuses. It is NOT thread-safe; give each thread its own ``Client``.
* ``AsyncClient`` is asyncio: any number of concurrent ``generate()`` / ``stream()`` calls share one
  DEALER socket per coordinator shard, whose reader task routes replies by request_id to per-request
  queues.

``stream()`` returns a ``TokenStream`` (``AsyncTokenStream``): iterate it for token ids as TOKENS
arrive; once it is exhausted, ``.result`` holds the same ``GenerateResult`` that ``generate()``
returns. Stopping early (``close()``, leaving a ``with`` block, or dropping the stream) sends ABORT.
Every timeout is a deadline for the whole request; when it passes, ABORT is sent and
``RequestTimeout`` raised. Replies that arrive for a request the client gave up on are dropped.

Modules: this one holds ``Client`` and ``TokenStream`` and re-exports the whole public API;
``async_client`` holds ``AsyncClient`` and ``AsyncTokenStream`` (``client_links`` its per-shard socket
and reader); ``client_request`` the sans-IO per-request core both run as I/O loops around (the body,
deadline, probes, when to give up on a shard, generate()'s retry); ``client_core`` the rest they share
(errors, ``GenerateResult``, request building, reply assembly, shard choice). None of them imports torch.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import zmq

from mserve.common.protocol import MsgType
from mserve.common.protocol.client import Error, Signed, StatusReply
from mserve.common.protocol.to_worker import SwitchRole
from mserve.common.sockets import bound_address, make_socket, send
from mserve.coordinator.async_client import AsyncClient, AsyncTokenStream
from mserve.coordinator.client_core import (PROBE_AFTER_S, Aborted, BadRequest, GenerateResult, Lost, MServeError,
                                            ModelNotFound, NoWorkers, Overloaded, Reply, RequestTimeout, ServerError,
                                            StreamState, Unauthorized, error_from_reply, logger, lost_reply,
                                            new_identity, new_request_id, normalize_client_messages, probe_body,
                                            recv_valid, send_abort, status_body)
from mserve.coordinator.client_request import ClientRequest, RequestMaker

__all__ = [
    "MServeError", "BadRequest", "Overloaded", "NoWorkers", "ModelNotFound", "RequestTimeout", "Aborted", "ServerError", "Lost",
    "GenerateResult", "normalize_client_messages", "error_from_reply", "Client", "AsyncClient",
    "TokenStream", "AsyncTokenStream", "Unauthorized",
]

if TYPE_CHECKING:  # the store loads torch; a client without one does not
    from mserve.common.media_store import MediaStore


# --------------------------------------------------------------------------- sync client


class Client(RequestMaker["TokenStream"]):
    """Synchronous client; one request at a time, not thread-safe.

    ``address`` is the coordinator's client address; for sharded coordinators (docs/scaling.md) a
    comma-separated list of them, or ``redis://...`` to read the live shards from their registry. Each
    request goes to one shard, picked by its id; a shard that stops answering is skipped, and
    ``generate()`` sends its request to another one.
    """

    def __init__(self, address: str, *, timeout_s: float = 120.0, probe_after_s: float = PROBE_AFTER_S,
                 api_key: str | None = None, direct_tokens: bool = False, tokens_host: str = "127.0.0.1",
                 media_store: MediaStore | None = None) -> None:
        self._setup(address, timeout_s, probe_after_s, api_key, media_store)
        self._ctx = zmq.Context()
        self._identity = new_identity()
        self._socks: dict[str, zmq.Socket] = {}  # one DEALER per shard, opened when first used
        self._current = self._shards.addresses[0]  # the shard of the request in flight
        self._last_heard = 0.0  # when a reply last came (a probe sent before it was answered)
        # direct_tokens: a token sink (a PULL socket bound on tokens_host, an address the workers can reach)
        # to which decode workers push a streamed request's tokens themselves, when the coordinator runs
        # with --token-report-every > 1 (docs/scaling.md); otherwise the tokens still come through it.
        self._sink: zmq.Socket | None = None
        self._sink_address: str | None = None
        if direct_tokens:
            self._sink = make_socket(self._ctx, zmq.PULL, bind=f"tcp://{tokens_host}:0")
            self._sink_address = bound_address(self._sink)
        # Weak, so a stream the caller dropped mid-way is finalized (ABORT sent) instead of pinned here.
        self._active: weakref.ref[TokenStream] | None = None
        self._closed = False

    @property
    def _sock(self) -> zmq.Socket:
        sock = self._socks.get(self._current)
        if sock is None:
            sock = self._socks[self._current] = make_socket(self._ctx, zmq.DEALER, connect=self._current,
                                                            identity=self._identity)
        return sock

    def generate(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
                 request_id: str | None = None, **sampling: Any) -> GenerateResult:
        """Send one request and wait for its result. ``sampling``: max_tokens=256, temperature=0.0, top_k=0,
        top_p=1.0 (common/sampling_rules.py), seed=None, stop_token_ids=(), ignore_eos=False, priority=0, latency_class="interactive",
        model=None (a served model's name; None: the coordinator's default), max_document_pages=8 (the most
        pages of a ``{"type": "document"}`` part, which is sent as its pages' images).

        With sharded coordinators, a request whose shard stopped answering is sent to another shard
        (nothing of it was handed out yet); with one coordinator, ``Lost`` is raised."""
        attempts = self._attempts(new_request_id(request_id), timeout_s)
        for left_s in attempts:
            try:
                return self._open(messages, False, left_s, attempts.request_id, sampling).exhaust()
            except Lost as exc:
                attempts.lost(exc)
        raise AssertionError("unreachable")

    def _open(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None,
               request_id: str | None, sampling: dict[str, Any]) -> TokenStream:
        self._check_idle()
        req = self._request(messages, stream, timeout_s, new_request_id(request_id), sampling, self._sink_address)
        self._current = req.begin(time.monotonic())
        until = req.send_until(time.monotonic())  # IMMEDIATE: a send blocks while the shard is unreachable
        if not self._send(MsgType.GENERATE, req.body, until):
            raise req.unsent(until, time.monotonic())
        tokens = TokenStream(self, req)
        self._active = weakref.ref(tokens)
        return tokens

    def _check_idle(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        active = self._active() if self._active is not None else None
        if active is not None and not active.done:  # its replies would be read, and lost, by this call
            raise RuntimeError("a stream is still open on this Client: exhaust or close() it first "
                               "(or use AsyncClient for concurrent requests)")

    def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The coordinator's STATUS_REPLY body: workers, roles, model, redis_healthy. With shards, the
        first shard not taken for dead answers; one that does not within its share of the timeout is
        taken for dead and the next is asked."""
        self._check_idle()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        shards = self._shards.up(time.monotonic())
        for i, address in enumerate(shards):
            self._current = address
            until = deadline if i == len(shards) - 1 else time.monotonic() + (deadline - time.monotonic()) / 2
            if not self._send(MsgType.STATUS, status_body(), until):
                if i < len(shards) - 1:
                    self._shards.mark_down(address, time.monotonic())
                continue
            while (reply := self._recv(until)) is not None:
                answer = reply[1]
                if isinstance(answer, StatusReply) and answer.unknown_requests is None:  # not a late probe answer
                    return answer.as_dict()
                if isinstance(answer, Error) and answer.request_id is None:  # e.g. unauthorized
                    raise error_from_reply(answer)
            if i < len(shards) - 1:
                self._shards.mark_down(address, time.monotonic())
        raise RequestTimeout(f"no STATUS reply from {self.address} within the deadline")

    def switch_role(self, worker_id: str, role: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Ask the coordinator to switch a worker to `role` (SWITCH_ROLE; docs/architecture.md, "Role
        switching"): its status once the switch has started (`role_switching` shows it), or BadRequest
        naming why not. With shards, the first shard not taken for dead is asked."""
        self._check_idle()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self._current = self._shards.up(time.monotonic())[0]
        if not self._send(MsgType.SWITCH_ROLE, SwitchRole(worker_id=worker_id, role=role).to_body(), deadline):
            raise RequestTimeout(f"coordinator at {self._current} is not reachable")
        while (reply := self._recv(deadline)) is not None:
            answer = reply[1]
            if isinstance(answer, StatusReply) and answer.unknown_requests is None:
                return answer.as_dict()
            if isinstance(answer, Error) and answer.request_id is None:
                raise error_from_reply(answer)
        raise RequestTimeout(f"no answer to SWITCH_ROLE from {self.address} within the deadline")

    def abort(self, request_id: str) -> None:
        """Ask the coordinator (the request's shard) to drop a request (best effort, no reply is awaited)."""
        if not self._closed:
            active = self._active() if self._active is not None else None
            if active is None or active.request_id != request_id:
                self._current = self._shards.pick(request_id, time.monotonic())
            send_abort(self._sock, request_id, self._api_key)

    def close(self) -> None:
        if self._closed:
            return
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._closed = True
        for sock in [*self._socks.values(), *([self._sink] if self._sink is not None else [])]:
            sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, kind: MsgType, payload: dict[str, Any], until: float) -> bool:
        """Send to the current shard, waiting until ``until`` at most for it to be reachable: whether it went."""
        while True:
            try:
                send(self._sock, kind, Signed.sign(payload, self._api_key), flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                remaining_ms = int((until - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not self._sock.poll(remaining_ms, zmq.POLLOUT):
                    return False

    def _recv(self, deadline: float) -> tuple[MsgType, Reply] | None:
        """The next valid reply (from the coordinator, or a worker through the token sink), or None once the
        deadline passes."""
        poller = zmq.Poller()
        for sock in (self._sock, self._sink):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while (remaining_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            ready = dict(poller.poll(remaining_ms))
            if not ready:
                return None
            for sock in ready:
                reply = recv_valid(sock)
                if reply is not None:
                    self._last_heard = time.monotonic()
                    return reply
        return None

    def _next_reply(self, req: ClientRequest) -> tuple[MsgType, Reply]:
        """The request's next reply; RequestTimeout past its deadline (ClientRequest.silent decides)."""
        request_id = req.request_id
        while True:
            reply = self._recv(req.wait_until(time.monotonic()))
            if reply is None:
                gone = req.silent(time.monotonic(), self._last_heard)
                if gone is not None:
                    return gone
                try:  # silent for a while: does the coordinator still hold it? (answered below)
                    send(self._sock, MsgType.STATUS, Signed.sign(probe_body([request_id]), self._api_key),
                         flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                continue
            kind, payload = reply
            if isinstance(payload, StatusReply) and request_id in (payload.unknown_requests or ()):
                return lost_reply(request_id)
            rid = getattr(payload, "request_id", None)
            # A null-id ERROR answers a message the server could not decode: with one request in
            # flight, that is this one.
            if rid == request_id or (kind == MsgType.ERROR and rid is None):
                return reply
            logger.debug("%s dropping stale %s", rid, kind.name)


class TokenStream(StreamState):
    """Iterator of token ids for one request of a sync Client; ``.result`` once exhausted."""

    def __init__(self, client: Client, req: ClientRequest) -> None:
        self.request_id = req.request_id
        self._client = client
        self._req = req
        self._asm = req.asm
        self._closed = False

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._asm.ready:
            if self.done:
                raise StopIteration
            try:
                self._asm.feed(*self._client._next_reply(self._req))
            except MServeError:  # RequestTimeout included
                self.close()
                raise
        return self._asm.ready.popleft()

    def exhaust(self) -> GenerateResult:
        """Read the whole request (generate()); its result."""
        with self:
            for _ in self:
                pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Stop early: sends ABORT unless the server already finished the request."""
        if not self.done and not self._client._closed:
            send_abort(self._client._sock, self.request_id, self._client._api_key)
        self._closed = True

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
