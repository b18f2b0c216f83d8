"""The asyncio client: many concurrent requests, one DEALER socket per coordinator shard (see coordinator/client.py).

Builds only on client_core, client_request (the sans-IO per-request core) and client_links (one shard's
socket and reader), never on client.py, which re-exports AsyncClient, so either module can be imported first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import zmq

from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.client import Error, StatusReply, Tokens
from mserve.coordinator.client_core import (PROBE_AFTER_S, Aborted, GenerateResult, Lost, MServeError, Reply,
                                            RequestTimeout, ServerError, StreamState, error_from_reply, logger,
                                            lost_reply, new_identity, new_request_id, send_abort, status_body)
from mserve.common.sockets import bound_address, make_socket
from mserve.coordinator.client_links import ShardLink
from mserve.coordinator.client_request import ClientRequest, RequestMaker

__all__ = ["AsyncClient", "AsyncTokenStream"]

# --------------------------------------------------------------------------- async client

if TYPE_CHECKING:  # the store loads torch; a client without one does not
    from mserve.common.media_store import MediaStore


class AsyncClient(RequestMaker["AsyncTokenStream"]):
    """asyncio client: many concurrent requests; one DEALER socket and one reader task per coordinator shard.

    ``address`` takes the same forms as ``Client``'s: the coordinator's client address, a
    comma-separated list of sharded coordinators, or ``redis://...`` to read the live shards from their
    registry (once, here; it blocks up to 5 s for one to appear). Each request goes to the shard its id
    picks (rendezvous hashing, common/shards.py). With several shards, a request whose shard
    leaves SHARD_PROBES_UNANSWERED probes in a row unanswered (nothing at all heard from it since), or
    cannot be reached to send it, ends as ``Lost``, the shard is skipped for a while, and ``generate()``
    sends the request to another one. With one coordinator, a silent request waits for its timeout.

    Each socket is a plain (sync) socket from ``make_socket`` used with NOBLOCK, and an asyncio shadow
    of it only waits for readiness (client_links.ShardLink): sends then never wait on the loop, so ABORT
    can go out from ``close()`` or a finalizer, and the shared ``send``/``recv`` helpers are used
    unchanged. Use it from one event loop.

    ``poll_interval_s`` bounds how late a reply can be read. A reader waits on its socket's
    edge-triggered FD, and a send on the same socket can consume a "readable" edge while replies sit
    unread; after each send the client reads what is queued, and the reader also looks at the socket
    every ``poll_interval_s`` even without an edge. The default (50 ms) costs nothing measurable; a
    benchmark timing every token wants a few milliseconds (mserve.bench.zmq_target uses 5 ms).

    ``direct_tokens``: as ``Client``'s, the client binds a token sink on ``tokens_host`` and streamed
    requests' tokens come from the decode workers straight to it (read by one more reader).
    """

    def __init__(self, address: str, *, timeout_s: float = 120.0, poll_interval_s: float = 0.05,
                 probe_after_s: float = PROBE_AFTER_S, api_key: str | None = None, direct_tokens: bool = False,
                 tokens_host: str = "127.0.0.1", media_store: MediaStore | None = None) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self._setup(address, timeout_s, probe_after_s, api_key, media_store)
        self.poll_interval_s = poll_interval_s
        self._ctx = zmq.Context()
        self._identity = new_identity()  # one identity on every shard's socket
        self._links: dict[str, ShardLink] = {}  # shard address -> its socket and reader, opened when first used
        self._pending: dict[str, asyncio.Queue[tuple[int | None, Any]]] = {}
        self._routes: dict[str, str] = {}  # request id -> the shard it was sent to (while pending)
        self._status_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._closed = False
        # The token sink (direct_tokens, see Client): workers push streamed requests' tokens here.
        self._sink: ShardLink | None = None
        if direct_tokens:
            sock = make_socket(self._ctx, zmq.PULL, bind=f"tcp://{tokens_host}:0")
            self._sink = ShardLink(self._ctx, bound_address(sock), identity=self._identity, api_key=None,
                                   poll_interval_s=poll_interval_s, on_reply=self._dispatch_direct,
                                   on_reader_failed=self._fail_requests_of, sock=sock)

    async def generate(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
                       request_id: str | None = None, **sampling: Any) -> GenerateResult:
        """Same arguments as ``Client.generate``. With sharded coordinators, a request whose shard stopped
        answering is sent to another shard (same id, same overall deadline); with one, ``Lost`` is raised."""
        attempts = self._attempts(new_request_id(request_id), timeout_s)
        for left_s in attempts:
            try:
                return await self._open(messages, False, left_s, attempts.request_id, sampling).exhaust()
            except Lost as exc:
                attempts.lost(exc)
        raise AssertionError("unreachable")

    def _open(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None,
                request_id: str | None, sampling: dict[str, Any]) -> AsyncTokenStream:
        if self._closed:
            raise RuntimeError("client is closed")
        rid = new_request_id(request_id)
        if rid in self._pending:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        tokens_to = self._sink.address if self._sink is not None else None
        return AsyncTokenStream(self, self._request(messages, stream, timeout_s, rid, sampling, tokens_to))

    async def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The STATUS_REPLY body of the first shard not taken for dead (the only one, unsharded)."""
        now = time.monotonic()
        link = self._link(self._shards.up(now)[0])
        link.ensure_reader()
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if not await link.send(MsgType.STATUS, status_body(), time.monotonic() + timeout):
                raise RequestTimeout(f"coordinator at {link.address} is not reachable")
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no STATUS reply from {link.address} within {timeout}s") from None
        finally:
            if waiter in self._status_waiters:
                self._status_waiters.remove(waiter)

    async def abort(self, request_id: str) -> None:
        """Ask the request's shard to drop it (best effort, no reply is awaited)."""
        if not self._closed:
            link = self._link(self._routes.get(request_id) or self._shards.pick(request_id, time.monotonic()))
            send_abort(link.sock, request_id, self._api_key)
            link.drain()

    async def close(self) -> None:
        """Abort what is in flight (each request on its own shard), stop the readers and close the sockets."""
        if self._closed:
            return
        self._closed = True
        for rid, queue in list(self._pending.items()):
            link = self._links.get(self._routes.get(rid, ""))
            if link is not None:
                send_abort(link.sock, rid, self._api_key)
            queue.put_nowait((None, Aborted("client closed", request_id=rid)))
        for link in [*self._links.values(), *([self._sink] if self._sink else [])]:
            await link.close()
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _link(self, address: str) -> ShardLink:
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = ShardLink(self._ctx, address, identity=self._identity,
                                                    api_key=self._api_key, poll_interval_s=self.poll_interval_s,
                                                    on_reply=self._dispatch, on_reader_failed=self._fail_requests_of)
        return link

    async def _send_generate(self, link: ShardLink, req: ClientRequest) -> None:
        until = req.send_until(time.monotonic())  # IMMEDIATE: a send waits while unreachable
        if not await link.send(MsgType.GENERATE, req.body, until):
            raise req.unsent(until, time.monotonic())

    def _silent(self, req: ClientRequest) -> tuple[MsgType, Reply] | None:
        """A silent request: what ClientRequest.silent decides; a probe goes to its shard (answered in
        _dispatch)."""
        assert req.shard is not None
        link = self._links[req.shard]
        gone = req.silent(time.monotonic(), link.last_heard)
        if gone is None:
            link.probe([req.request_id])
        return gone

    def _fail_requests_of(self, address: str, exc: Exception) -> None:
        for rid, queue in self._pending.items():
            if self._routes.get(rid) == address:
                queue.put_nowait((None, ServerError(f"client reader failed: {exc}", request_id=rid)))

    def _dispatch_direct(self, kind: MsgType, payload: Reply, address: str) -> None:
        """TOKENS a worker pushed to the token sink: the request's, whichever shard runs it."""
        queue = self._pending.get(payload.request_id) if isinstance(payload, Tokens) else None
        if queue is not None:
            queue.put_nowait((kind, payload))

    def _dispatch(self, kind: MsgType, payload: Reply, address: str) -> None:
        """Route one reply from the shard at ``address``; a request's replies count only from its own shard."""
        if isinstance(payload, StatusReply) and payload.unknown_requests is not None:  # a probe's answer
            for rid in payload.unknown_requests:
                queue = self._pending.get(rid)
                if queue is not None and self._routes.get(rid) == address:
                    queue.put_nowait(lost_reply(rid))
            return
        if isinstance(payload, StatusReply):
            while self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(payload.as_dict())
                    return
            return
        rid = payload.request_id
        if rid is None and isinstance(payload, Error) and payload.code == ErrorCode.UNAUTHORIZED:
            # A refused STATUS (a refused GENERATE or ABORT names its request): fail the oldest waiter.
            while self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(error_from_reply(payload))
                    return
            logger.warning("coordinator refused a message: %s", payload.message)
            return
        if rid is None and kind == MsgType.ERROR:  # undecodable-message error: if only one request it can be
            here = [r for r in self._pending if self._routes.get(r) == address]
            rid = here[0] if len(here) == 1 else None
        queue = self._pending.get(rid) if rid is not None and self._routes.get(rid) == address else None
        if queue is None:
            level = logging.WARNING if rid is None else logging.DEBUG
            logger.log(level, "%s dropping %s for no pending request: %s", rid, kind.name,
                       payload.message if isinstance(payload, Error) else "")
            return
        queue.put_nowait((kind, payload))


class AsyncTokenStream(StreamState):
    """Async iterator of token ids for one request of an AsyncClient; ``.result`` once exhausted."""

    def __init__(self, client: AsyncClient, req: ClientRequest) -> None:
        self.request_id = req.request_id
        self._client = client
        self._req = req  # its shard is picked when the request is sent
        self._queue: asyncio.Queue[tuple[int | None, Any]] | None = None
        self._asm = req.asm
        self._closed = False

    @property
    def shard(self) -> str | None:
        """The coordinator shard's address, picked when the request is sent."""
        return self._req.shard

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> int:
        if not await self._fill():
            raise StopAsyncIteration
        return self._asm.ready.popleft()

    async def chunks(self) -> AsyncIterator[list[int]]:
        """The token ids grouped by arrival: ``async for ids in stream.chunks()``.

        Each list holds the tokens one reply added (a TOKENS message, or the tail only RESULT
        carried), so the time an item is received is the arrival time of all its tokens. Use either
        this or token-by-token iteration on one stream, not both. ``.result`` is set once exhausted.
        """
        while await self._fill():
            ids = list(self._asm.ready)
            self._asm.ready.clear()
            yield ids

    async def exhaust(self) -> GenerateResult:
        """Read the whole request (generate()); its result."""
        async with self:
            async for _ in self:
                pass
        assert self.result is not None
        return self.result

    async def _fill(self) -> bool:
        """Wait until tokens are ready (True) or the request is over (False); sends on first use."""
        if self._queue is None and not self._closed:
            await self._start()
        while not self._asm.ready:
            if self.done:
                self._release()
                return False
            assert self._queue is not None
            now = time.monotonic()
            reply: tuple[Any, Any] | None
            try:
                reply = await asyncio.wait_for(self._queue.get(), self._req.wait_until(now) - now)
            except asyncio.TimeoutError:
                reply = None
            except asyncio.CancelledError:
                self.close()
                raise
            if reply is None:
                try:  # silent for a while: does its coordinator still hold it?
                    reply = self._client._silent(self._req)
                except RequestTimeout:
                    self.close()
                    raise
                if reply is None:
                    continue
            kind, payload = reply
            if kind is None:  # the client failed this request locally (closed, reader died)
                self._closed = True
                self._release()
                raise payload
            try:
                self._asm.feed(kind, payload)
            except MServeError:
                self.close()
                raise
        return True

    async def _start(self) -> None:
        client = self._client
        if client._closed:
            raise RuntimeError("client is closed")
        link = client._link(self._req.begin(time.monotonic()))
        link.ensure_reader()
        if client._sink is not None:
            client._sink.ensure_reader()
        self._queue = asyncio.Queue()
        client._pending[self.request_id] = self._queue  # registered before sending: no reply can be missed
        client._routes[self.request_id] = link.address
        try:
            await client._send_generate(link, self._req)
        except BaseException:
            self._closed = True
            self._release()
            raise

    def close(self) -> None:
        """Stop early: sends ABORT (to its shard) unless the server already finished (or it was never sent)."""
        if not self.done and self._queue is not None and not self._client._closed:
            send_abort(self._client._links[self._req.shard].sock, self.request_id, self._client._api_key)
        self._closed = True
        self._release()

    async def aclose(self) -> None:
        self.close()

    def _release(self) -> None:
        client = self._client
        if self._queue is not None and client._pending.get(self.request_id) is self._queue:
            del client._pending[self.request_id]
            client._routes.pop(self.request_id, None)

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
