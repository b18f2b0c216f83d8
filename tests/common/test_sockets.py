"""Tests for mserve.common.sockets: options, port-0 binds, and a real ROUTER<->DEALER exchange over TCP."""

from __future__ import annotations

import errno
import re
import socket
import threading

import pytest
import torch
import zmq

from mserve.common.serde import WireError, encode
from mserve.common.sockets import bound_address, free_port, make_socket, recv, send

TIMEOUT_MS = 5000


class _Ctx(zmq.Context):
    """Keeps its sockets alive until teardown closes them, so none is GC'd unclosed mid-test."""

    opened: list[zmq.Socket]

    def socket(self, *args, **kwargs):
        sock = super().socket(*args, **kwargs)
        self.opened.append(sock)
        return sock


@pytest.fixture
def ctx():
    context = _Ctx()
    context.opened = []
    yield context
    for sock in context.opened:
        sock.close(linger=0)
    if not context.closed:
        context.term()


def _recv(sock: zmq.Socket):
    assert sock.poll(TIMEOUT_MS, zmq.POLLIN), "no message within timeout"
    return recv(sock)


def _pair(ctx: zmq.Context, identity: bytes = b"worker-1"):
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    dealer = make_socket(ctx, zmq.DEALER, connect=bound_address(router), identity=identity)
    return router, dealer


def test_bind_port_zero_resolves(ctx):
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    addr = bound_address(sock)
    m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", addr)
    assert m and int(m[1]) > 0
    assert sock.getsockopt(zmq.LAST_ENDPOINT).decode() == addr


def test_wildcard_bind_gives_connectable_address(ctx):
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://*:0")
    addr = bound_address(router)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", addr)
    dealer = make_socket(ctx, zmq.DEALER, connect=addr)
    send(dealer, 1, "hi")
    ident, mt, body = _recv(router)
    assert (mt, body) == (1, "hi") and ident


def test_options_applied(ctx):
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0", hwm=123, linger_ms=7)
    dealer = make_socket(ctx, zmq.DEALER, connect=bound_address(router), identity=b"abc")
    for s, hwm in ((router, 123), (dealer, 10000)):
        assert s.getsockopt(zmq.SNDHWM) == hwm
        assert s.getsockopt(zmq.RCVHWM) == hwm
        assert s.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert s.getsockopt(zmq.TCP_KEEPALIVE_IDLE) > 0
        assert s.getsockopt(zmq.TCP_KEEPALIVE_INTVL) > 0
        assert s.getsockopt(zmq.TCP_KEEPALIVE_CNT) > 0
    assert router.getsockopt(zmq.LINGER) == 7
    assert dealer.getsockopt(zmq.LINGER) == 0
    assert dealer.getsockopt(zmq.IMMEDIATE) == 1
    assert router.getsockopt(zmq.IMMEDIATE) == 0
    assert dealer.getsockopt(zmq.IDENTITY) == b"abc"


@pytest.mark.parametrize("identity", [b"", b"\x00abc", b"x" * 256])
def test_bad_identity_rejected(ctx, identity):
    with pytest.raises(ValueError):
        make_socket(ctx, zmq.DEALER, identity=identity)


def test_failed_bind_closes_socket(ctx):
    holder = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    with pytest.raises(zmq.ZMQError):
        make_socket(ctx, zmq.ROUTER, bind=bound_address(holder))
    # A leaked socket would make term() hang; destroy() in the fixture would hide it.
    holder.close()
    terminator = threading.Thread(target=ctx.term, daemon=True)
    terminator.start()
    terminator.join(5)
    assert not terminator.is_alive(), "a socket from the failed make_socket was leaked"


def test_router_dealer_roundtrip_with_1mb_tensor(ctx):
    router, dealer = _pair(ctx)
    big = torch.randn(512, 512, dtype=torch.float32)  # 1 MiB
    embeds = torch.randn(64, 256).to(torch.bfloat16)
    body = {"req": "r-1", "pixels": big, "extra": [embeds, torch.tensor(3)]}
    send(dealer, 4, body)
    ident, mt, got = _recv(router)
    assert ident == b"worker-1" and mt == 4 and got["req"] == "r-1"
    assert torch.equal(got["pixels"], big)
    assert torch.equal(got["extra"][0], embeds) and got["extra"][1].item() == 3

    send(router, 5, {"ok": True, "echo": got["pixels"]}, identity=ident)
    ident2, mt2, reply = _recv(dealer)
    assert ident2 is None and mt2 == 5 and reply["ok"] is True
    assert torch.equal(reply["echo"], big)


def test_router_mandatory_unknown_identity_raises(ctx):
    router, dealer = _pair(ctx)
    send(dealer, 1, None)  # make sure the ROUTER knows about at least one real peer
    _recv(router)
    with pytest.raises(zmq.ZMQError) as info:
        send(router, 1, {"x": 1}, identity=b"nobody")
    assert info.value.errno == errno.EHOSTUNREACH


def test_identity_argument_checked(ctx):
    router, dealer = _pair(ctx)
    with pytest.raises(ValueError):
        send(router, 1, None)
    with pytest.raises(ValueError):
        send(dealer, 1, None, identity=b"x")


def test_recv_malformed_message_raises_wire_error(ctx):
    router, dealer = _pair(ctx)
    dealer.send_multipart([b"\x01\x02", b"\xc1"])
    with pytest.raises(WireError):
        _recv(router)
    frames = encode(2, torch.ones(1000))
    dealer.send_multipart(frames[:2])  # tensor frame missing
    with pytest.raises(WireError):
        _recv(router)
    # The socket is still usable after bad messages.
    send(dealer, 3, "fine")
    assert _recv(router)[1:] == (3, "fine")


def test_recv_noblock_raises_again(ctx):
    router, _ = _pair(ctx)
    with pytest.raises(zmq.Again):
        recv(router, flags=zmq.NOBLOCK)


def test_free_port_is_bindable():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
