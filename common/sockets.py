"""ZeroMQ socket factory and ROUTER/DEALER send/recv wrappers; the one place socket options live.

Option choices (``make_socket``):
* SNDHWM/RCVHWM: bounded queues; ``hwm`` counts messages, not frames.
* LINGER 0 by default so ``close()``/``ctx.term()`` never hang on an unreachable peer at shutdown.
* TCP keepalive (idle 30 s, probe every 10 s, 3 probes): a peer whose host vanished without a
  FIN is detected in about a minute instead of the OS default of hours.
* IMMEDIATE on connecting DEALERs: messages are queued only to completed connections, so a
  DEALER whose peer is down blocks (or raises ``zmq.Again`` with NOBLOCK) instead of silently
  buffering into a pipe that may never connect.
* ROUTER_MANDATORY on ROUTERs: sending to an identity with no connected peer raises
  ``zmq.ZMQError`` (errno ``EHOSTUNREACH``) instead of the default silent drop, so the
  coordinator learns a worker is gone. Side effect: a ROUTER send to a peer whose HWM is
  full blocks (or raises ``zmq.Again`` with NOBLOCK) instead of dropping.

``send``/``recv`` use mserve.common.serde and zero-copy frames; see serde's docstring for the buffer
lifetime rules (do not mutate a sent tensor in place; received tensors alias zmq frames).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any

import zmq

from mserve.common.serde import WireError, decode, encode

__all__ = ["make_socket", "bound_address", "send", "recv", "free_port"]

_KEEPALIVE_IDLE_S = 30
_KEEPALIVE_INTVL_S = 10
_KEEPALIVE_CNT = 3

# LAST_ENDPOINT of a wildcard bind names the wildcard, which is not something a peer can dial.
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "*": "127.0.0.1"}
_TCP_ENDPOINT = re.compile(r"^tcp://(?P<host>.+):(?P<port>\d+)$")


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    identity: bytes | None = None,
    hwm: int = 10000,
    linger_ms: int = 0,
    curve: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """Create a socket of ``kind`` (zmq.ROUTER, zmq.DEALER, ...) with the project's options.

    ``bind`` accepts port 0 (``tcp://127.0.0.1:0``, ``tcp://*:0``) for a random free port; read it
    back with ``bound_address``. ``identity`` (1..255 bytes, not starting with NUL, which
    libzmq reserves) must be set here because it only takes effect before connecting. ``curve``
    sets the socket's CURVE keys before it binds or connects (``Gate.apply`` or
    ``CurveKeys.client(...)`` from mserve.common.security); None leaves it unauthenticated. On a
    failed bind/connect the socket is closed before the error propagates.
    """
    if identity is not None and not (1 <= len(identity) <= 255 and identity[0] != 0):
        raise ValueError("identity must be 1..255 bytes and must not start with a NUL byte")
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTVL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, _KEEPALIVE_CNT)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.DEALER and connect is not None:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if curve is not None:
            curve(sock)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The endpoint a peer on this host can connect to, e.g. ``tcp://127.0.0.1:54321``.

    Resolves port 0 to the real port, and maps a wildcard host (``0.0.0.0``, ``[::]``) to
    loopback. For peers on other hosts, advertise this host's routable address instead.
    """
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(endpoint, bytes):
        endpoint = endpoint.decode()
    if not endpoint:
        raise ValueError("socket is not bound")
    match = _TCP_ENDPOINT.match(endpoint)
    if match and match["host"] in _WILDCARD_HOSTS:
        return f"tcp://{_WILDCARD_HOSTS[match['host']]}:{match['port']}"
    return endpoint


def send(
    sock: zmq.Socket,
    msg_type: int,
    body: Any,
    *,
    identity: bytes | None = None,
    flags: int = 0,
) -> None:
    """Encode and send one message with zero-copy frames.

    ROUTER sockets need ``identity`` (the peer to route to); other kinds must not get one.
    ``flags`` is passed to ``send_multipart`` (e.g. ``zmq.NOBLOCK``).
    """
    frames: list[Any] = encode(msg_type, body)
    if sock.type == zmq.ROUTER:
        if identity is None:
            raise ValueError("sending on a ROUTER socket needs the peer identity")
        frames.insert(0, identity)
    elif identity is not None:
        raise ValueError("identity is only meaningful on ROUTER sockets")
    sock.send_multipart(frames, flags=flags, copy=False)


def recv(sock: zmq.Socket, *, flags: int = 0) -> tuple[bytes | None, int, Any]:
    """Receive and decode one message: ``(identity, msg_type, body)``.

    ``identity`` is the sender's routing id on ROUTER sockets and None otherwise. Frames are
    received with ``copy=False``, so large tensors in ``body`` alias the zmq frames (no copy).
    Raises ``WireError`` for a malformed message (the message is consumed either way) and
    ``zmq.Again`` under NOBLOCK when nothing is queued.
    """
    frames = sock.recv_multipart(flags=flags, copy=False)
    identity: bytes | None = None
    if sock.type == zmq.ROUTER:
        if len(frames) < 2:
            raise WireError("ROUTER message has no frames after the identity")
        identity = frames[0].bytes
        frames = frames[1:]
    msg_type, body = decode(frames)
    return identity, msg_type, body


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago. Racy by nature: prefer binding to port 0 and
    reading ``bound_address`` whenever the binding process can report its own address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host_or_address: str) -> bool:
    """Whether a host ("127.0.0.1", "localhost", "::1") or a "tcp://host:port" address is this machine's loopback:
    a peer on another host cannot reach it."""
    host = host_or_address.rpartition("//")[2] if "//" in host_or_address else host_or_address
    if "//" in host_or_address or host.count(":") == 1:
        host = host.rpartition(":")[0]
    host = host.strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
