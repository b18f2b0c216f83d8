"""The asyncio client: many concurrent requests over one DEALER socket (see coordinator/client.py).

Builds only on client_core (never on client.py, which re-exports AsyncClient), so either module can be
imported first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Sequence

import zmq
import zmq.asyncio

from mserve.common import protocol
from mserve.common.protocol import MsgType
from mserve.common.sockets import make_socket, send
from mserve.coordinator.client_core import (PROBE_AFTER_S, Aborted, Assembler, GenerateResult, MServeError,
                                            RequestTimeout, ServerError, StreamState, generate_body, logger,
                                            lost_reply, new_identity, new_request_id, probe_body, recv_valid,
                                            send_abort)
from mserve.common.protocol import ErrorCode
from mserve.coordinator.client_core import client_api_key, error_from_reply, with_api_key

__all__ = ["AsyncClient", "AsyncTokenStream"]

# --------------------------------------------------------------------------- async client


class AsyncClient:
    """asyncio client: many concurrent requests over one DEALER socket and one reader task.

    The socket is a plain (sync) socket from ``make_socket`` used with NOBLOCK, and an asyncio shadow
    of it only waits for readiness: sends then never wait on the loop, so ABORT can go out from
    ``close()`` or a finalizer, and the shared ``send``/``recv`` helpers are used unchanged.
    Use it from one event loop.

    ``poll_interval_s`` bounds how late a reply can be read. The reader waits on the socket's
    edge-triggered FD, and a send on the same socket can consume a "readable" edge while replies sit
    unread; after each send the client reads what is queued, and the reader also looks at the socket
    every ``poll_interval_s`` even without an edge. The default (50 ms) costs nothing measurable; a
    benchmark timing every token wants a few milliseconds (mserve.bench.zmq_target uses 5 ms).
    """

    def __init__(self, address: str, *, timeout_s: float = 120.0, poll_interval_s: float = 0.05,
                 probe_after_s: float = PROBE_AFTER_S, api_key: str | None = None) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.address = address
        self._api_key = client_api_key(api_key)  # sent in every message; default $MSERVE_CLIENT_API_KEY
        self.timeout_s = timeout_s
        self.probe_after_s = probe_after_s  # a request this silent is checked with the coordinator
        self.poll_interval_s = poll_interval_s
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=address, identity=new_identity())
        self._waiter: zmq.asyncio.Socket | None = None  # created inside the running loop
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Queue[tuple[int | None, Any]]] = {}
        self._status_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._closed = False

    async def generate(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
                       request_id: str | None = None, **sampling: Any) -> GenerateResult:
        """Same arguments as ``Client.generate``."""
        async with self._stream(messages, False, timeout_s, request_id, sampling) as s:
            async for _ in s:
                pass
        assert s.result is not None
        return s.result

    def stream(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
               request_id: str | None = None, **sampling: Any) -> AsyncTokenStream:
        """``async for tok in client.stream(...)``; the request is sent on the first iteration."""
        return self._stream(messages, True, timeout_s, request_id, sampling)

    def _stream(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None,
                request_id: str | None, sampling: dict[str, Any]) -> AsyncTokenStream:
        if self._closed:
            raise RuntimeError("client is closed")
        rid = new_request_id(request_id)
        if rid in self._pending:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        payload = generate_body(rid, messages, stream, **sampling)
        return AsyncTokenStream(self, rid, payload, self.timeout_s if timeout_s is None else timeout_s)

    async def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        self._ensure_reader()
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            await self._send(MsgType.STATUS, protocol.body(), time.monotonic() + timeout, None)
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no STATUS reply from {self.address} within {timeout}s") from None
        finally:
            if waiter in self._status_waiters:
                self._status_waiters.remove(waiter)

    async def abort(self, request_id: str) -> None:
        if not self._closed:
            send_abort(self._sock, request_id, self._api_key)
            self._drain()

    async def close(self) -> None:
        """Abort what is in flight, stop the reader and close the socket."""
        if self._closed:
            return
        self._closed = True
        for rid, queue in list(self._pending.items()):
            send_abort(self._sock, rid, self._api_key)
            queue.put_nowait((None, Aborted("client closed", request_id=rid)))
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            if self._waiter is None:
                self._waiter = zmq.asyncio.Socket.from_socket(self._sock)
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _send(self, kind: MsgType, payload: dict[str, Any], deadline: float, request_id: str | None) -> None:
        assert self._waiter is not None
        while True:
            try:
                send(self._sock, kind, with_api_key(payload, self._api_key), flags=zmq.NOBLOCK)
                # A send on the shared socket can consume the "readable" edge of its FD, and the
                # reader would then wait forever on replies already queued: read them here.
                if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._drain()
                return
            except zmq.Again:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not await self._waiter.poll(remaining_ms, zmq.POLLOUT):
                    raise RequestTimeout(f"coordinator at {self.address} is not reachable",
                                         request_id=request_id) from None

    def _drain(self) -> None:
        while True:
            try:
                reply = recv_valid(self._sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if reply is not None:
                self._dispatch(*reply)

    async def _read_loop(self) -> None:
        assert self._waiter is not None
        poll_ms = max(1, round(self.poll_interval_s * 1000))
        try:
            while True:
                # Edge-triggered FD: also look every poll_ms in case an edge was consumed elsewhere.
                await self._waiter.poll(poll_ms, zmq.POLLIN)
                self._drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead reader would hang every caller: fail them instead
            logger.exception("client reader stopped")
            for rid, queue in self._pending.items():
                queue.put_nowait((None, ServerError(f"client reader failed: {exc}", request_id=rid)))

    def _probe(self, request_ids: list[str]) -> None:
        """Ask (without waiting) whether the coordinator still holds these requests; see _dispatch."""
        try:
            send(self._sock, MsgType.STATUS, with_api_key(probe_body(request_ids), self._api_key), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # no coordinator connected right now: the next probe asks again
            pass

    def _dispatch(self, kind: MsgType, payload: dict[str, Any]) -> None:
        if kind == MsgType.STATUS_REPLY and "unknown_requests" in payload:  # a probe's answer
            for rid in payload.get("unknown_requests") or ():
                queue = self._pending.get(rid)
                if queue is not None:
                    queue.put_nowait(lost_reply(rid))
            return
        if kind == MsgType.STATUS_REPLY:
            while self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(payload)
                    return
            return
        rid = payload.get("request_id")
        if rid is None and kind == MsgType.ERROR and payload.get("code") == ErrorCode.UNAUTHORIZED:
            # A refused STATUS (a refused GENERATE or ABORT names its request): fail the oldest waiter.
            while self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(error_from_reply(payload))
                    return
            logger.warning("coordinator refused a message: %s", payload.get("message", ""))
            return
        if rid is None and kind == MsgType.ERROR and len(self._pending) == 1:
            rid = next(iter(self._pending))  # undecodable-message error: only one request it can be
        queue = self._pending.get(rid) if rid is not None else None
        if queue is None:
            level = logging.WARNING if rid is None else logging.DEBUG
            logger.log(level, "%s dropping %s for no pending request: %s", rid, kind.name, payload.get("message", ""))
            return
        queue.put_nowait((kind, payload))


class AsyncTokenStream(StreamState):
    """Async iterator of token ids for one request of an AsyncClient; ``.result`` once exhausted."""

    def __init__(self, client: AsyncClient, request_id: str, payload: dict[str, Any], timeout_s: float) -> None:
        self.request_id = request_id
        self._client = client
        self._payload = payload
        self._timeout_s = timeout_s
        self._deadline = 0.0
        self._queue: asyncio.Queue[tuple[int | None, Any]] | None = None
        self._asm = Assembler(request_id)
        self._closed = False

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

    async def _fill(self) -> bool:
        """Wait until tokens are ready (True) or the request is over (False); sends on first use."""
        if self._queue is None and not self._closed:
            await self._start()
        while not self._asm.ready:
            if self.done:
                self._release()
                return False
            assert self._queue is not None
            left = self._deadline - time.monotonic()
            try:
                kind, payload = await asyncio.wait_for(self._queue.get(), min(left, self._client.probe_after_s))
            except asyncio.TimeoutError:
                if time.monotonic() < self._deadline:  # silent for a while: does the coordinator still hold it?
                    self._client._probe([self.request_id])
                    continue
                self.close()
                raise RequestTimeout(f"no result within {self._timeout_s}s; request aborted",
                                     request_id=self.request_id) from None
            except asyncio.CancelledError:
                self.close()
                raise
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
        client._ensure_reader()
        self._queue = asyncio.Queue()
        client._pending[self.request_id] = self._queue  # registered before sending: no reply can be missed
        self._deadline = time.monotonic() + self._timeout_s
        try:
            await client._send(MsgType.GENERATE, self._payload, self._deadline, self.request_id)
        except BaseException:
            self._closed = True
            self._release()
            raise

    def close(self) -> None:
        """Stop early: sends ABORT unless the server already finished (or it was never sent)."""
        if not self.done and self._queue is not None and not self._client._closed:
            send_abort(self._client._sock, self.request_id, self._client._api_key)
        self._closed = True
        self._release()

    async def aclose(self) -> None:
        self.close()

    def _release(self) -> None:
        if self._client._pending.get(self.request_id) is self._queue:
            del self._client._pending[self.request_id]

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: sockets may already be gone
            pass
