"""mserve.common.transfer.Descriptor: wire round trip, every malformed field rejected by name."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest
import torch

from mserve.common.transfer import Descriptor, TransferEngine, TransferError
from mserve.common.transfer.descriptor import DESCRIPTOR_VERSION, LayoutEntry


def shm_wire() -> dict[str, Any]:
    """A well-formed shm descriptor in today's wire layout (version 2)."""
    return {
        "v": 2, "id": "req-1:0:kv", "backend": "shm", "sender": "prefill-0",
        "instance": "0123456789abcdef", "address": "tcp://127.0.0.1:5555",
        "host_id": "boot/4026531839", "nbytes": 192,
        "tensors": [["kv", "bfloat16", [2, 3, 4], 0], ["pos", "int64", [3], 64],
                    ["empty", "float32", [0, 7], 128]],
        "shm": "mserve_ab_123_cafe", "shm_nonce": 42, "shm_gen": 3,
    }


def torch_wire() -> dict[str, Any]:
    wire = {k: v for k, v in shm_wire().items() if not k.startswith("shm")}
    return dict(wire, backend="torch", pg="gloo")


def test_version_is_unchanged() -> None:
    assert DESCRIPTOR_VERSION == 2


@pytest.mark.parametrize("make", [shm_wire, torch_wire])
def test_wire_round_trip(make: Any) -> None:
    wire = make()
    desc = Descriptor.from_wire(wire)
    assert desc.to_wire() == wire and list(desc.to_wire()) == list(wire)  # same keys, same order
    assert Descriptor.from_wire(msgpack.unpackb(msgpack.packb(desc.to_wire()))) == desc
    assert desc.tensors[0] == LayoutEntry("kv", torch.bfloat16, (2, 3, 4), 0)
    assert desc.payload_nbytes == 2 * 3 * 4 * 2 + 3 * 8


def test_typed_fields() -> None:
    desc = Descriptor.from_wire(shm_wire())
    assert (desc.id, desc.backend, desc.nbytes) == ("req-1:0:kv", "shm", 192)
    assert (desc.shm, desc.shm_nonce, desc.shm_gen, desc.pg) == ("mserve_ab_123_cafe", 42, 3, None)
    assert [e.name for e in desc.tensors] == ["kv", "pos", "empty"]
    with pytest.raises(AttributeError):
        desc.id = "other"  # type: ignore[misc]  # frozen


def test_unknown_keys_are_ignored() -> None:
    assert Descriptor.from_wire(dict(shm_wire(), extra=1)).to_wire() == shm_wire()


def test_published_descriptors_round_trip() -> None:
    tensors = {"a": torch.arange(10.0), "b": torch.ones(2, 3, dtype=torch.int32)}
    with TransferEngine("desc-tx") as tx:
        for backend in ("shm", "tcp", "torch", "auto"):
            desc = tx.publish(f"t-{backend}", tensors, backend=backend)
            assert isinstance(desc, Descriptor) and desc.backend == backend
            assert Descriptor.from_wire(desc.to_wire()) == desc
            assert desc.address == tx.address and desc.sender == "desc-tx"
            tx.release(desc.id)
        with pytest.raises(TypeError, match="transfer ids must be str"):
            tx.publish(7, tensors)  # type: ignore[arg-type]


def _with(**changes: Any) -> dict[str, Any]:
    return dict(shm_wire(), **changes)


def _tensor(i: int, **changes: Any) -> dict[str, Any]:
    wire = shm_wire()
    entry = dict(zip(("name", "dtype", "shape", "offset"), wire["tensors"][i]), **changes)
    wire["tensors"][i] = list(entry.values())
    return wire


def _without(key: str) -> dict[str, Any]:
    wire = shm_wire()
    del wire[key]
    return wire


MALFORMED = [
    # (wire dict, field named in the error)
    (_with(v=1), "'v'"),
    (_with(v=3), "'v'"),
    (_with(v="2"), "'v'"),
    (_with(v=2.0), "'v'"),
    (_without("v"), "'v'"),
    (_with(id=5), "'id'"),
    (_with(id=None), "'id'"),
    (_with(backend="rdma"), "'backend'"),
    (_with(backend=None), "'backend'"),
    (_with(sender=b"prefill-0"), "'sender'"),
    (_with(instance=1), "'instance'"),
    (_with(address=["tcp://x:1"]), "'address'"),
    (_with(host_id=0), "'host_id'"),
    (_with(nbytes=-1), "'nbytes'"),
    (_with(nbytes="192"), "'nbytes'"),
    (_with(nbytes=True), "'nbytes'"),
    (_with(nbytes=1.5), "'nbytes'"),
    (_with(tensors="kv"), "'tensors'"),
    (_with(tensors={"kv": 1}), "'tensors'"),
    (_with(tensors=[["kv", "float32", [1]]]), "'tensors[0]'"),
    (_with(tensors=[["kv", "float32", [1], 0], "x"]), "'tensors[1]'"),
    (_tensor(0, name=7), "'tensors[0].name'"),
    (_tensor(1, name="kv"), "'tensors[1].name'"),  # a repeated name
    (_tensor(0, dtype="complex64"), "'tensors[0].dtype'"),
    (_tensor(0, dtype="__class__"), "'tensors[0].dtype'"),
    (_tensor(0, dtype=5), "'tensors[0].dtype'"),
    (_tensor(1, shape=[-3]), "'tensors[1].shape'"),
    (_tensor(1, shape=[3.0]), "'tensors[1].shape'"),
    (_tensor(1, shape=3), "'tensors[1].shape'"),
    (_tensor(1, shape=[True]), "'tensors[1].shape'"),
    (_tensor(2, offset=-64), "'tensors[2].offset'"),
    (_tensor(2, offset="128"), "'tensors[2].offset'"),
    (_tensor(1, offset=180), "'tensors[1].offset'"),  # runs past nbytes
    (_with(nbytes=80), "'tensors[1].offset'"),  # a buffer too small for its tensors
    (_without("id"), "'id'"),
    (_without("tensors"), "'tensors'"),
    (_without("nbytes"), "'nbytes'"),
    (_without("shm"), "'shm'"),  # shm and auto descriptors name their segment
    (_without("shm_nonce"), "'shm_nonce'"),
    (_without("shm_gen"), "'shm_gen'"),
    (_with(backend="auto", shm=None), "'shm'"),
    (_with(shm=7), "'shm'"),
    (_with(shm_nonce=-1), "'shm_nonce'"),
    (_with(shm_gen="3"), "'shm_gen'"),
    (dict(torch_wire(), pg="mpi"), "'pg'"),
    (dict(torch_wire(), shm_gen=-1), "'shm_gen'"),  # optional fields are still checked
]


@pytest.mark.parametrize(
    "wire,field", MALFORMED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(MALFORMED)]
)
def test_malformed_field_is_named(wire: dict[str, Any], field: str) -> None:
    with pytest.raises(TransferError, match="malformed transfer descriptor") as info:
        Descriptor.from_wire(wire)
    assert field in str(info.value)


@pytest.mark.parametrize("obj", [None, [], "desc", b"\x80", 42])
def test_not_a_dict(obj: Any) -> None:
    with pytest.raises(TransferError, match="must be a dict"):
        Descriptor.from_wire(obj)


def test_direct_construction_is_checked_too() -> None:
    desc = Descriptor.from_wire(shm_wire())
    with pytest.raises(TransferError, match="'backend'"):
        replace(desc, backend="udp")
    with pytest.raises(TransferError, match="'tensors'"):
        replace(desc, tensors=list(desc.tensors))
    with pytest.raises(TransferError, match=r"'tensors\[0\].dtype'"):
        replace(desc, tensors=(LayoutEntry("x", torch.complex64, (1,), 0),))


def test_engine_rejects_malformed_wire_dicts() -> None:
    """A bad dict off the network is a TransferError naming the field, counted as a fetch error."""
    with TransferEngine("desc-rx") as rx:
        for wire, field in [(_with(backend="rdma"), "'backend'"), (_tensor(0, dtype="x"), "dtype"),
                            (_with(v=1), "'v'")]:
            with pytest.raises(TransferError, match=field):
                rx.fetch(wire, timeout_s=1)
            with pytest.raises(TransferError, match=field):
                rx.fetch_view(wire, timeout_s=1)
            with pytest.raises(TransferError, match=field):
                rx.release_fetched(wire)
        assert rx.stats()["fetch_errors"] == 6
        rx.release_fetched("never-fetched")  # a bare id still works, and is idempotent
