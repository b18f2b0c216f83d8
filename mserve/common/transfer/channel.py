"""The data plane's wire between a fetching receiver and a sender's ROUTER: message types and
the receiver's cached DEALER sockets.

Why cached: opening a DEALER (and its TCP connection) for every fetch cost 0.3-0.5 ms on a
2-core host, as much as moving a request's 10 MiB of KV through shared memory. A receiver keeps
its DEALERs per (thread, sender address) instead: zmq sockets are not thread-safe, so every
thread that fetches gets its own and fetch stays callable from any thread.

Requests and acks use separate sockets (see ``_socket``). A late reply can never be mistaken
for the answer to a later request: every request carries a
fresh ``rq`` number that the sender echoes and replies with another number are discarded, and a
socket whose request failed (timeout, malformed reply) is closed instead of reused.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from typing import Any

import zmq

from mserve.common.serde import WireError
from mserve.common.sockets import make_socket, recv, send
from mserve.common.transfer.descriptor import TransferError

__all__ = ["Msg", "Channels", "send_nowait"]

logger = logging.getLogger(__name__)

# Acks are fire-and-forget; linger lets one still queued leave when the engine closes.
_ACK_LINGER_MS = 250


class Msg(enum.IntEnum):
    # Private to the data-plane socket; the control plane's types live elsewhere.
    REQUEST = 1
    DATA = 2
    READY = 3
    ERROR = 4
    ACK = 5


def send_nowait(sock: zmq.Socket, msg_type: int, body: Any, identity: bytes | None = None) -> bool:
    try:
        send(sock, msg_type, body, identity=identity, flags=zmq.NOBLOCK)
        return True
    except (zmq.Again, zmq.ZMQError) as exc:  # peer gone or full: it will time out and retry
        logger.debug("data-plane send dropped: %s", exc)
        return False


def _remaining_ms(deadline: float) -> int:
    return int(max(0.0, deadline - time.monotonic()) * 1000)


class Channels:
    """A receiver's DEALERs per (thread, sender address), opened on first use: one for
    requests, one for acks."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[zmq.Socket] = set()  # every thread's sockets, for close()
        self._rq = itertools.count(1)
        self._closed = False

    def _sockets(self, kind: str = "requests") -> dict[str, zmq.Socket]:
        socks = getattr(self._local, kind, None)
        if socks is None:
            socks = {}
            setattr(self._local, kind, socks)
        return socks

    def _socket(self, address: str, where: str, kind: str = "requests") -> zmq.Socket:
        socks = self._sockets(kind)
        sock = socks.get(address)
        if sock is None:
            try:
                if kind == "requests":
                    sock = make_socket(self._ctx, zmq.DEALER, connect=address)
                else:
                    # Acks go on a socket of their own without IMMEDIATE: an ack may be a
                    # receiver's first message to a sender (shm sends nothing else), and it
                    # must queue while the connection is still being set up, not be dropped.
                    sock = make_socket(self._ctx, zmq.DEALER, linger_ms=_ACK_LINGER_MS)
                    sock.connect(address)
            except zmq.ZMQError as exc:
                raise TransferError(f"{where}: cannot connect: {exc}") from exc
            socks[address] = sock
            with self._lock:
                self._open.add(sock)
        return sock

    def drop(self, address: str) -> None:
        sock = self._sockets().pop(address, None)
        if sock is not None:
            with self._lock:
                self._open.discard(sock)
            sock.close(linger=0)

    def request(self, address: str, body: dict, where: str, deadline: float) -> dict:
        """Send one REQUEST and return the sender's DATA/READY reply; TransferError otherwise
        (``where`` names the transfer in messages)."""
        sock = self._socket(address, where)
        rq = next(self._rq)
        try:
            # IMMEDIATE on the DEALER means it is writable only once connected: a dead sender
            # shows up as "never writable" rather than as a request silently queued forever.
            if not sock.poll(_remaining_ms(deadline), zmq.POLLOUT):
                raise TransferError(f"{where}: cannot connect to the sender (gone?) within the timeout")
            send_nowait(sock, Msg.REQUEST, {**body, "rq": rq})
            while True:
                if not sock.poll(_remaining_ms(deadline), zmq.POLLIN):
                    raise TransferError(f"{where}: no reply from the sender within the timeout")
                try:
                    _, msg_type, reply = recv(sock)
                except WireError as exc:
                    raise TransferError(f"{where}: malformed reply: {exc}") from exc
                if not isinstance(reply, dict) or reply.get("rq", rq) == rq:
                    break
                logger.debug("%s: dropped a late reply to request %s", where, reply.get("rq"))
        except TransferError:
            self.drop(address)
            raise
        if msg_type == Msg.ERROR:
            raise TransferError(f"{where}: {reply.get('error')}")
        if msg_type not in (Msg.DATA, Msg.READY) or not isinstance(reply, dict):
            self.drop(address)
            raise TransferError(f"{where}: unexpected reply type {msg_type}")
        return reply

    def ack(self, address: str, transfer_id: str) -> None:
        """Tell the sender this receiver is done with ``transfer_id`` (fire-and-forget; a no-op
        after ``close``)."""
        if self._closed:
            return
        try:
            sock = self._socket(address, f"ack of {transfer_id!r}", kind="acks")
        except TransferError as exc:
            logger.debug("%s", exc)
            return
        send_nowait(sock, Msg.ACK, {"id": transfer_id})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._open = list(self._open), set()
        for sock in socks:
            sock.close(linger=_ACK_LINGER_MS)
