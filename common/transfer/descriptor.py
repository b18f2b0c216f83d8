"""The transfer descriptor: what a receiver needs to fetch one transfer, typed and checked.

A sender's ``publish`` returns a ``Descriptor``; the control plane carries ``to_wire()`` (a plain
msgpack-able dict) and a receiver turns it back with ``Descriptor.from_wire``, which checks
every field: a malformed descriptor from the network is a ``TransferError`` naming the field, never
a KeyError deep inside a fetch. Wire layout (``v`` = ``DESCRIPTOR_VERSION``)::

    {"v": 2, "id": transfer_id, "backend": "shm"|"tcp"|"torch"|"auto",
     "sender": worker_id, "instance": engine nonce, "address": "tcp://host:port",
     "host_id": "...", "nbytes": packed bytes,
     "tensors": [[name, dtype, shape, offset], ...],
     "shm": segment name, "shm_nonce": int, "shm_gen": int (shm/auto only),
     "pg": "gloo"|"nccl" (torch only),
     "key": Z85 CURVE public key of the sender's data plane (only when it requires CURVE)}

Keys the receiver does not know are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mserve.common.security import is_public_key
from mserve.common.serde import DTYPE_NAMES, DTYPES

__all__ = [
    "TransferError", "LayoutEntry", "Descriptor", "as_descriptor",
    "BACKENDS", "SHM_BACKENDS", "PG_BACKENDS", "DESCRIPTOR_VERSION",
]

DESCRIPTOR_VERSION = 2
BACKENDS = ("auto", "shm", "tcp", "torch")
SHM_BACKENDS = ("shm", "auto")  # descriptors that name a shared-memory segment
PG_BACKENDS = ("gloo", "nccl")


class TransferError(RuntimeError):
    """A fetch failed (sender gone, transfer unknown or expired, timeout, transport error,
    malformed descriptor). The transfer may be retried or re-routed; nothing was half-delivered
    to the caller."""


@dataclass(frozen=True)
class LayoutEntry:
    """One tensor of a transfer: its bytes start ``offset`` bytes into the packed buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _bad(field: str, problem: str, value: Any) -> TransferError:
    return TransferError(f"malformed transfer descriptor: field {field!r} {problem}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(field, "must be a str", value)


def _check_count(field: str, value: Any) -> None:
    if not (_is_int(value) and value >= 0):
        raise _bad(field, "must be a non-negative int", value)


@dataclass(frozen=True)
class Descriptor:
    """One published transfer, as its receiver sees it. Constructing one checks every field
    (``TransferError`` naming the first bad one)."""

    id: str
    backend: str  # one of BACKENDS
    sender: str  # the sender's worker id
    instance: str  # the sender engine's nonce (tells a restarted worker id apart)
    address: str  # the sender's data-plane ROUTER, "tcp://host:port"
    host_id: str  # which shm namespace the sender sees (transfer.backends.host_id)
    nbytes: int  # packed buffer size, alignment padding included
    tensors: tuple[LayoutEntry, ...]
    shm: str | None = None  # segment name (shm/auto)
    shm_nonce: int | None = None
    shm_gen: int | None = None
    pg: str | None = None  # process-group backend (torch)
    key: str | None = None  # the sender's CURVE public key (Z85): its data plane admits CURVE peers only
    # Many receivers (a media store's item, common/media_store.py): acks do not free it, only its
    # release or expiry does, and a receiver may fetch it again.
    shared: bool = False

    def __post_init__(self) -> None:
        for name in ("id", "sender", "instance", "address", "host_id"):
            _check_str(name, getattr(self, name))
        if self.backend not in BACKENDS:
            raise _bad("backend", f"must be one of {BACKENDS}", self.backend)
        _check_count("nbytes", self.nbytes)
        self._check_tensors()
        if self.backend in SHM_BACKENDS or self.shm is not None:
            _check_str("shm", self.shm)
        if self.backend in SHM_BACKENDS or self.shm_nonce is not None:
            _check_count("shm_nonce", self.shm_nonce)
        if self.backend in SHM_BACKENDS or self.shm_gen is not None:
            _check_count("shm_gen", self.shm_gen)
        if self.pg is not None and self.pg not in PG_BACKENDS:
            raise _bad("pg", f"must be one of {PG_BACKENDS}", self.pg)
        if self.key is not None and not is_public_key(self.key):
            raise _bad("key", "must be a 40-character Z85 CURVE public key", self.key)

    def _check_tensors(self) -> None:
        if not isinstance(self.tensors, tuple):
            raise _bad("tensors", "must be a tuple of LayoutEntry", self.tensors)
        seen: set[str] = set()
        for i, e in enumerate(self.tensors):
            where = f"tensors[{i}]"
            if not isinstance(e, LayoutEntry):
                raise _bad(where, "must be a LayoutEntry", e)
            _check_str(f"{where}.name", e.name)
            if e.name in seen:
                raise _bad(f"{where}.name", "repeats an earlier tensor's name", e.name)
            seen.add(e.name)
            if not isinstance(e.dtype, torch.dtype) or e.dtype not in DTYPE_NAMES:
                raise _bad(f"{where}.dtype", f"must be one of {sorted(DTYPES)}", e.dtype)
            if not (isinstance(e.shape, tuple) and all(_is_int(d) and d >= 0 for d in e.shape)):
                raise _bad(f"{where}.shape", "must be a list of non-negative ints", e.shape)
            _check_count(f"{where}.offset", e.offset)
            if e.offset + e.nbytes > self.nbytes:
                raise _bad(f"{where}.offset",
                           f"puts {e.name!r} ({e.nbytes} B) outside the {self.nbytes}-byte buffer",
                           e.offset)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of tensor data (``nbytes`` less the alignment padding)."""
        return sum(e.nbytes for e in self.tensors)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able dict the control plane carries (layout in the module docstring)."""
        wire: dict[str, Any] = {
            "v": DESCRIPTOR_VERSION, "id": self.id, "backend": self.backend,
            "sender": self.sender, "instance": self.instance, "address": self.address,
            "host_id": self.host_id, "nbytes": self.nbytes,
            "tensors": [[e.name, DTYPE_NAMES[e.dtype], list(e.shape), e.offset]
                        for e in self.tensors],
        }
        for name in ("shm", "shm_nonce", "shm_gen", "pg", "key"):
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        if self.shared:
            wire["shared"] = True
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> Descriptor:
        """Parse and check a wire dict; ``TransferError`` naming the bad field otherwise."""
        if not isinstance(obj, dict):
            raise TransferError(
                f"malformed transfer descriptor: must be a dict, got {type(obj).__name__}")
        if obj.get("v") != DESCRIPTOR_VERSION or not _is_int(obj.get("v")):
            raise _bad("v", f"must be version {DESCRIPTOR_VERSION}", obj.get("v"))
        fields: dict[str, Any] = {}
        for name in ("id", "backend", "sender", "instance", "address", "host_id", "nbytes",
                     "tensors"):
            if name not in obj:
                raise TransferError(f"malformed transfer descriptor: field {name!r} is missing")
            fields[name] = obj[name]
        for name in ("shm", "shm_nonce", "shm_gen", "pg", "key"):
            fields[name] = obj.get(name)
        fields["shared"] = obj.get("shared") is True
        fields["tensors"] = _layout_from_wire(fields["tensors"])
        return cls(**fields)


def _layout_from_wire(wire: Any) -> tuple[LayoutEntry, ...]:
    """The ``tensors`` list as LayoutEntries; value checks are left to ``Descriptor``."""
    if not isinstance(wire, (list, tuple)):
        raise _bad("tensors", "must be a list of [name, dtype, shape, offset]", wire)
    entries = []
    for i, item in enumerate(wire):
        if not (isinstance(item, (list, tuple)) and len(item) == 4):
            raise _bad(f"tensors[{i}]", "must be [name, dtype, shape, offset]", item)
        name, dtype, shape, offset = item
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _bad(f"tensors[{i}].dtype", f"must be one of {sorted(DTYPES)}", dtype)
        if isinstance(shape, list):
            shape = tuple(shape)
        entries.append(LayoutEntry(name, DTYPES[dtype], shape, offset))
    return tuple(entries)


def as_descriptor(obj: Any) -> Descriptor:
    """A ``Descriptor`` as is, or one parsed from its wire dict (``Descriptor.from_wire``)."""
    if isinstance(obj, Descriptor):
        return obj
    return Descriptor.from_wire(obj)
