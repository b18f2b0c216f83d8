"""Key files, the CURVE data plane (unknown receivers refused), and no pickle on the data plane."""

from __future__ import annotations

import logging
import pickle
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
import zmq

from mserve.common.security import CurveKeys, SecurityError, check_curve_settings, keygen, load_public_key
from mserve.common.serde import decode
from mserve.common.sockets import make_socket
from mserve.common.transfer import Descriptor, TransferEngine, TransferError


class Boom:
    """Unpickling this creates ``path``: proof that a payload was (or was never) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def pickle_frames(marker: Path) -> list[list[bytes]]:
    """A pickle payload as a type byte + body, and as a lone frame."""
    payload = pickle.dumps(Boom(marker))
    return [[b"\x01", payload], [payload]]


# --------------------------------------------------------------------------- key files


def test_keygen_writes_a_keypair_with_private_secret(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path / "keys", "worker-0")
    assert (public.name, secret.name) == ("worker-0.key", "worker-0.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    keys = CurveKeys.from_files(str(secret))
    assert keys.public == load_public_key(public) and len(keys.public) == len(keys.secret) == 40
    assert "secret-key" not in public.read_text()

    with pytest.raises(SecurityError, match="exists already"):
        keygen(tmp_path / "keys", "worker-0")
    public2, _ = keygen(tmp_path / "keys", "worker-0", force=True)
    assert load_public_key(public2) != keys.public
    with pytest.raises(SecurityError, match="key name"):
        keygen(tmp_path, "../evil")


def test_key_settings_are_checked(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "a")
    with pytest.raises(SecurityError, match="holds no secret key"):
        CurveKeys.from_files(str(public))
    with pytest.raises(SecurityError, match="cannot read"):
        CurveKeys.from_files(str(tmp_path / "missing.key_secret"))
    with pytest.raises(SecurityError, match="not a folder"):
        CurveKeys.from_files(str(secret), authorized_keys=str(tmp_path / "nope"))
    assert check_curve_settings("w", a=None, b="") is False
    assert check_curve_settings("w", a="x", b="y") is True
    with pytest.raises(SecurityError, match="b given but not a"):
        check_curve_settings("w", a=None, b="y")


def test_descriptor_carries_a_checked_key(tmp_path: Path) -> None:
    key = load_public_key(keygen(tmp_path, "a")[0]).decode()
    wire = Descriptor(id="t", backend="tcp", sender="a", instance="i", address="tcp://127.0.0.1:1", host_id="h",
                      nbytes=0, tensors=(), key=key).to_wire()
    assert wire["key"] == key and Descriptor.from_wire(wire).key == key
    with pytest.raises(TransferError, match="field 'key'"):
        Descriptor.from_wire({**wire, "key": "not a key"})
    del wire["key"]
    assert Descriptor.from_wire(wire).key is None  # an unauthenticated sender's descriptor


# --------------------------------------------------------------------------- the CURVE data plane


@pytest.fixture
def curve_engines(tmp_path: Path):
    """Sender `a` admits `b` only; `c` has a keypair nobody authorized; `p` has no keys at all."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    for name in "abc":
        keygen(tmp_path, name)
    shutil.copy(tmp_path / "b.key", authorized / "b.key")

    def keys(name: str) -> CurveKeys:
        return CurveKeys.from_files(str(tmp_path / f"{name}.key_secret"), authorized_keys=str(authorized))

    engines = {n: TransferEngine(n, backend="tcp", curve=keys(n)) for n in "abc"}
    engines["p"] = TransferEngine("p", backend="tcp")
    yield engines, tmp_path, authorized
    for engine in engines.values():
        engine.close()


def test_data_plane_refuses_unknown_receivers(curve_engines) -> None:
    engines, keydir, authorized = curve_engines
    a, b, c, p = (engines[n] for n in "abcp")
    tensors = {"x": torch.arange(4096, dtype=torch.float32)}
    desc = a.publish("t1", tensors)
    assert desc.key == a.key == load_public_key(keydir / "a.key").decode()
    assert torch.equal(b.fetch(desc, timeout_s=10)["x"], tensors["x"])

    desc = a.publish("t2", tensors)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="refused this process's CURVE key.*authorized keys"):
        c.fetch(desc, timeout_s=10)
    assert time.monotonic() - t0 < 5, "a refused handshake fails the fetch at once, not at the timeout"
    with pytest.raises(TransferError, match="requires CURVE"):
        p.fetch(desc, timeout_s=2)
    plain = p.publish("t3", tensors)
    with pytest.raises(TransferError, match="not CURVE-protected"):
        b.fetch(plain, timeout_s=2)

    # The folder is re-read when it changes: authorizing c lets it in without a restart.
    shutil.copy(keydir / "c.key", authorized / "c.key")
    assert torch.equal(c.fetch(desc, timeout_s=10)["x"], tensors["x"])
    assert a.stats()["served"] == 2


def test_a_plain_socket_gets_nothing_from_a_curve_data_plane(curve_engines) -> None:
    engines, _, _ = curve_engines
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, connect=engines["a"].address)
    try:  # IMMEDIATE: never writable, since the CURVE handshake never completes
        assert not sock.poll(500, zmq.POLLOUT)
    finally:
        sock.close(0)


# --------------------------------------------------------------------------- no pickle on the wire


def test_data_plane_drops_pickle_and_keeps_serving(tmp_path: Path, caplog) -> None:
    marker = tmp_path / "unpickled"
    tensors = {"x": torch.arange(1024, dtype=torch.int64)}
    with TransferEngine("s", backend="tcp") as sender, TransferEngine("r") as receiver:
        ctx = zmq.Context.instance()
        sock = make_socket(ctx, zmq.DEALER, connect=sender.address)
        caplog.set_level(logging.WARNING, logger="mserve.common.transfer.server")
        try:
            for frames in pickle_frames(marker):
                sock.send_multipart(frames)
            deadline = time.monotonic() + 10
            while caplog.text.count("malformed data-plane message dropped") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert caplog.text.count("malformed data-plane message dropped") == 2
            assert not sock.poll(100), "a malformed message gets no reply"
            desc = sender.publish("after", tensors)
            assert torch.equal(receiver.fetch(desc, timeout_s=10)["x"], tensors["x"])
        finally:
            sock.close(0)
    assert not marker.exists()


def test_serde_never_unpickles(tmp_path: Path) -> None:
    from mserve.common.serde import WireError

    marker = tmp_path / "unpickled"
    for frames in pickle_frames(marker):
        with pytest.raises(WireError):
            decode(frames)
    assert not marker.exists()


def test_unauthorized_maps_to_its_own_error() -> None:
    from mserve.common.protocol import ErrorCode
    from mserve.coordinator.client import Unauthorized, error_from_reply
    from mserve.gateway.openai_api import status_for_code

    exc = error_from_reply({"request_id": "r", "code": ErrorCode.UNAUTHORIZED, "message": "missing api_key"})
    assert isinstance(exc, Unauthorized) and exc.code == "unauthorized"
    assert status_for_code(ErrorCode.UNAUTHORIZED)[0] == 502  # the gateway's own key is wrong: not the caller's
