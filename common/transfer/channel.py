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

With CURVE (``keys``), every DEALER is a CURVE client of the sender's public key (the descriptor's
``key``), cached per (thread, address, key); a request socket also watches its handshake, so a
sender that refuses this engine's key fails the fetch at once with that reason instead of a timeout.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import zmq

from mserve.common.protocol import ProtocolError
from mserve.common.protocol.data_plane import (TO_RECEIVER, Ack, DataMsg, FetchFailed, FetchRequest, TensorData,
                                               TorchReady, parse_data)
from mserve.common.security import CurveKeys, HandshakeWatch
from mserve.common.serde import WireError
from mserve.common.sockets import make_socket, recv, send
from mserve.common.transfer.descriptor import TransferError

__all__ = ["Msg", "Channels", "send_nowait"]

logger = logging.getLogger(__name__)

# Acks are fire-and-forget; linger lets one still queued leave when the engine closes.
_ACK_LINGER_MS = 250


Msg = DataMsg  # the data plane's message types (common/protocol/data_plane.py)


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

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None = None) -> None:
        self._ctx = ctx
        self.keys = keys
        self._watches: dict[zmq.Socket, HandshakeWatch] = {}  # CURVE request sockets' handshakes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[zmq.Socket] = set()  # every thread's sockets, for close()
        self._rq = itertools.count(1)
        self._closed = False

    def _sockets(self, kind: str = "requests") -> dict[tuple[str, str | None], zmq.Socket]:
        socks = getattr(self._local, kind, None)
        if socks is None:
            socks = {}
            setattr(self._local, kind, socks)
        return socks

    def _socket(self, address: str, where: str, kind: str = "requests",
                server_key: str | None = None) -> zmq.Socket:
        socks = self._sockets(kind)
        sock = socks.get((address, server_key))
        if sock is None:
            curve = self.keys.client(server_key) if self.keys is not None and server_key else None
            try:
                if kind == "requests":
                    sock = make_socket(self._ctx, zmq.DEALER, connect=address, curve=curve)
                    if curve is not None:
                        watch = HandshakeWatch(sock)
                        with self._lock:
                            self._watches[sock] = watch
                else:
                    # Acks go on a socket of their own without IMMEDIATE: an ack may be a
                    # receiver's first message to a sender (shm sends nothing else), and it
                    # must queue while the connection is still being set up, not be dropped.
                    sock = make_socket(self._ctx, zmq.DEALER, linger_ms=_ACK_LINGER_MS, curve=curve)
                    sock.connect(address)
            except zmq.ZMQError as exc:
                raise TransferError(f"{where}: cannot connect: {exc}") from exc
            socks[(address, server_key)] = sock
            with self._lock:
                self._open.add(sock)
        return sock

    def drop(self, address: str, server_key: str | None = None) -> None:
        sock = self._sockets().pop((address, server_key), None)
        if sock is not None:
            with self._lock:
                self._open.discard(sock)
                watch = self._watches.pop(sock, None)
            if watch is not None:
                watch.close()
            sock.close(linger=0)

    def _wait_writable(self, sock: zmq.Socket, where: str, deadline: float) -> None:
        """IMMEDIATE on the DEALER means it is writable only once connected: a dead sender shows
        up as "never writable" rather than as a request silently queued forever. Under CURVE a
        refused handshake ends the wait at once, with its reason."""
        watch = self._watches.get(sock)
        if watch is None:
            if not sock.poll(_remaining_ms(deadline), zmq.POLLOUT):
                raise TransferError(f"{where}: cannot connect to the sender (gone?) within the timeout")
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLOUT)
        poller.register(watch.socket, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_remaining_ms(deadline)))
            if events.get(sock, 0) & zmq.POLLOUT:
                return
            why = watch.failure()
            if why is not None:
                raise TransferError(f"{where}: cannot connect to the sender: {why}")
            if not events and _remaining_ms(deadline) <= 0:
                raise TransferError(f"{where}: cannot connect to the sender (gone, or a CURVE handshake "
                                    "that never completed: wrong server key?) within the timeout")

    def request(self, address: str, req: FetchRequest, where: str, deadline: float,
                server_key: str | None = None) -> TensorData | TorchReady:
        """Send one REQUEST and return the sender's DATA/READY reply; TransferError otherwise
        (``where`` names the transfer in messages; ``server_key``: the sender's CURVE key)."""
        sock = self._socket(address, where, server_key=server_key)
        rq = next(self._rq)
        try:
            self._wait_writable(sock, where, deadline)
            req.rq = rq
            send_nowait(sock, Msg.REQUEST, req.to_body())
            while True:
                if not sock.poll(_remaining_ms(deadline), zmq.POLLIN):
                    raise TransferError(f"{where}: no reply from the sender within the timeout")
                try:
                    _, msg_type, body = recv(sock)
                    reply = parse_data(msg_type, body, TO_RECEIVER)
                except (WireError, ProtocolError) as exc:
                    raise TransferError(f"{where}: malformed reply: {exc}") from exc
                if reply.rq is None or reply.rq == rq:
                    break
                logger.debug("%s: dropped a late reply to request %s", where, reply.rq)
        except TransferError:
            self.drop(address, server_key)
            raise
        if isinstance(reply, FetchFailed):
            raise TransferError(f"{where}: {reply.error}")
        return reply

    def ack(self, address: str, transfer_id: str, server_key: str | None = None) -> None:
        """Tell the sender this receiver is done with ``transfer_id`` (fire-and-forget; a no-op
        after ``close``)."""
        if self._closed:
            return
        try:
            sock = self._socket(address, f"ack of {transfer_id!r}", kind="acks", server_key=server_key)
        except TransferError as exc:
            logger.debug("%s", exc)
            return
        send_nowait(sock, Msg.ACK, Ack(id=transfer_id).to_body())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._open = list(self._open), set()
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.close()
        for sock in socks:
            sock.close(linger=_ACK_LINGER_MS)
