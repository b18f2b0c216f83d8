"""An AsyncClient's connection to one coordinator shard: socket, readiness waiter, reader task, last heard.

Used by async_client.py only; builds on client_core alone (no torch, nothing of client.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from mserve.common.protocol import MsgType
from mserve.common.protocol.client import Signed
from mserve.common.sockets import make_socket, send
from mserve.coordinator.client_core import Reply, logger, probe_body, recv_valid

__all__ = ["ShardLink"]


class ShardLink:
    """One coordinator shard as an AsyncClient sees it: a DEALER socket, the asyncio shadow that waits
    for its readiness, the reader task that hands each reply to ``on_reply(kind, payload, address)``,
    and when the shard was last heard from (any message at all, malformed ones included).

    The socket is a plain (sync) socket from ``make_socket`` used with NOBLOCK; the shadow only waits.
    Its FD is edge-triggered, and a send can consume a "readable" edge while replies sit unread: after
    a send the link reads what is queued, and the reader also looks every ``poll_interval_s``.
    """

    def __init__(self, ctx: zmq.Context, address: str, *, identity: bytes, api_key: str | None,
                 poll_interval_s: float, on_reply: Callable[[MsgType, Reply, str], None],
                 on_reader_failed: Callable[[str, Exception], None], sock: zmq.Socket | None = None) -> None:
        self.address = address
        # `sock`: a socket of the caller's instead (the client's token sink, a bound PULL: read only).
        self.sock = sock if sock is not None else make_socket(ctx, zmq.DEALER, connect=address, identity=identity)
        self.last_heard = 0.0  # monotonic time of the last message read from this shard
        self._api_key = api_key
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._on_reply = on_reply
        self._on_reader_failed = on_reader_failed
        self._waiter: zmq.asyncio.Socket | None = None  # created inside the running loop
        self._reader: asyncio.Task[None] | None = None

    def ensure_reader(self) -> None:
        """Start (or restart) the reader task; call from the event loop before sending."""
        if self._reader is None or self._reader.done():
            if self._waiter is None:
                self._waiter = zmq.asyncio.Socket.from_socket(self.sock)
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def send(self, kind: MsgType, payload: dict[str, Any], until: float) -> bool:
        """Send without blocking the loop; False when the shard could not take it by ``until`` (unreachable)."""
        assert self._waiter is not None
        while True:
            try:
                send(self.sock, kind, Signed.sign(payload, self._api_key), flags=zmq.NOBLOCK)
            except zmq.Again:  # IMMEDIATE: no connection to the shard right now
                remaining_ms = int((until - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not await self._waiter.poll(remaining_ms, zmq.POLLOUT):
                    return False
                continue
            # The send may have consumed the readable edge, and the reader would then wait on
            # replies already queued: read them here.
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.drain()
            return True

    def probe(self, request_ids: list[str]) -> None:
        """Ask (without waiting) whether the shard still holds these requests (``unknown_requests``)."""
        try:
            send(self.sock, MsgType.STATUS, Signed.sign(probe_body(request_ids), self._api_key), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # not connected right now: the next probe asks again
            pass

    def drain(self) -> None:
        """Hand every queued reply to ``on_reply`` (malformed ones are logged and dropped)."""
        while True:
            try:
                reply = recv_valid(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            if reply is not None:
                self._on_reply(*reply, self.address)

    async def _read_loop(self) -> None:
        assert self._waiter is not None
        try:
            while True:
                # Edge-triggered FD: also look every poll_ms in case an edge was consumed elsewhere.
                await self._waiter.poll(self._poll_ms, zmq.POLLIN)
                self.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead reader would hang its requests: fail them instead
            logger.exception("client reader of %s stopped", self.address)
            self._on_reader_failed(self.address, exc)

    async def close(self) -> None:
        """Stop the reader and close the socket (the context is the client's to term)."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self.sock.close(linger=0)
