"""Byte movers behind the transfer engine: tensor layouts and the per-backend sender storages.

Pooled shm segments live in mserve.common.transfer.shm_pool, torch pair groups in
mserve.common.transfer.torch_pairs, the wire form of a layout in mserve.common.transfer.descriptor.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed

from mserve.common.serde import DTYPE_NAMES
from mserve.common.transfer.descriptor import LayoutEntry, TransferError
from mserve.common.transfer.shm_pool import HEADER, Segment, SegmentPool

logger = logging.getLogger(__name__)

__all__ = [
    "ALIGN",
    "host_id",
    "plan_layout",
    "plan_layout_spec",
    "segment_views",
    "TensorStorage",
    "SegmentStorage",
    "FlatStorage",
    "pack_flat",
    "unpack_flat",
    "stage",
]

# 64 B keeps every tensor cache-line aligned and satisfies the alignment of every dtype below,
# so views into a segment or flat buffer never need a fix-up copy.
ALIGN = 64

# The closed dtype table of mserve.common.serde: a descriptor names dtypes, and a name must never
# be able to reach an arbitrary attribute of the torch module.
_DTYPE_NAMES = DTYPE_NAMES


def host_id() -> str:
    """Identifies 'can see the same POSIX shm segments': same machine (boot id) and same IPC
    namespace (containers without --ipc=host get a private /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ipc = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc = 0
    return f"{boot}/{ipc}"


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[LayoutEntry], int]:
    """Aligned offsets for packing ``tensors`` back to back; returns (entries, total bytes)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is {type(t).__name__}, not a torch.Tensor")
    return plan_layout_spec({name: (t.shape, t.dtype) for name, t in tensors.items()})


def plan_layout_spec(
    spec: dict[str, tuple[Any, torch.dtype]],
) -> tuple[list[LayoutEntry], int]:
    """``plan_layout`` for tensors yet to be written: ``{name: (shape, dtype)}``."""
    entries: list[LayoutEntry] = []
    offset = 0
    for name, (shape, dtype) in spec.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name!r}: unsupported dtype {dtype}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"{name!r}: negative dimension in {shape}")
        entry = LayoutEntry(name, dtype, shape, offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, offset


def _view(buf: Any, e: LayoutEntry, base: int = 0) -> torch.Tensor:
    """A tensor aliasing ``e``'s bytes at ``base + e.offset`` inside a writable buffer (no copy).
    It keeps ``buf`` alive for as long as it lives."""
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)  # frombuffer rejects count=0
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=base + e.offset)
    return raw.view(e.dtype).view(e.shape)


def segment_views(buf: Any, entries: Sequence[LayoutEntry]) -> dict[str, torch.Tensor]:
    """The tensors of a transfer inside a shm segment's mapping (sender's or receiver's)."""
    return {e.name: _view(buf, e, HEADER) for e in entries}


# --------------------------------------------------------------------------- sender storages
# Each published transfer owns one storage until it is freed. ``free(recycle)`` returns False
# when the memory is still referenced (zmq has not finished sending views of it) and must be
# retried; ``recycle`` says the one receiver is done, so the memory may serve a later transfer.


class TensorStorage:
    """tcp: the published tensors themselves (contiguous, CPU), served as zero-copy frames."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def free(self, recycle: bool = False) -> bool:
        self._tensors = {}
        return True


class SegmentStorage:
    """shm (and auto): the tensors at aligned offsets in one pooled shared-memory segment."""

    def __init__(self, pool: SegmentPool, entries: list[LayoutEntry], total: int) -> None:
        self._pool = pool
        self.segment: Segment = pool.acquire(total)
        self.entries = entries
        self.nbytes = total
        self._returned = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Writable views into the segment (to fill it, or to serve it over tcp)."""
        return segment_views(self.segment.buf, self.entries)

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        try:
            for e in self.entries:
                if e.nbytes:
                    _view(self.segment.buf, e, HEADER).copy_(tensors[e.name])
            if any(t.is_cuda for t in tensors.values()):
                torch.cuda.synchronize()
        except BaseException:
            self.free()
            raise

    def free(self, recycle: bool = False) -> bool:
        if self._returned:  # a retry: only the unmap was left to do
            return self.segment.destroy()
        self._returned = True
        return self._pool.recycle(self.segment) if recycle else self._pool.discard(self.segment)


class FlatStorage:
    """torch: every tensor packed into one flat uint8 buffer, so a transfer is one send."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.nbytes = flat.numel()

    def free(self, recycle: bool = False) -> bool:
        self.flat = torch.empty(0, dtype=torch.uint8)
        return True


def pack_flat(
    tensors: dict[str, torch.Tensor], entries: list[LayoutEntry], total: int, device: str
) -> torch.Tensor:
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for e in entries:
        if e.nbytes:
            flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    if flat.is_cuda:
        # The send runs on another thread's stream; make the packing visible to it first.
        torch.cuda.current_stream(flat.device).synchronize()
    return flat


def unpack_flat(flat: torch.Tensor, entries: Sequence[LayoutEntry]) -> dict[str, torch.Tensor]:
    """Views into ``flat``: the tensors share (and keep alive) the one buffer."""
    out = {}
    for e in entries:
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=e.dtype, device=flat.device)
        else:
            out[e.name] = flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
    return out


def stage(
    kind: str, layout: tuple[list[LayoutEntry], int], tensors: dict[str, torch.Tensor] | None,
    *, pool: SegmentPool, device: str,
) -> tuple[Any, str]:
    """The storage a ``kind`` transfer is served from, filled with ``tensors`` when given (else
    left for the caller to fill), and the backend it ends up on: ``auto`` falls back to tcp
    when shared memory is unavailable or full."""
    entries, total = layout
    if kind in ("shm", "auto"):
        try:
            storage = SegmentStorage(pool, entries, total)
        except OSError as exc:
            if kind == "shm":
                raise TransferError(f"cannot stage {total} B in shared memory: {exc}") from exc
            logger.warning("shm staging failed (%s); publishing over tcp", exc)
            kind = "tcp"
        else:
            if tensors is not None:
                storage.fill(tensors)
            return storage, kind
    if kind == "tcp":
        if tensors is None:
            tensors = {e.name: torch.empty(e.shape, dtype=e.dtype) for e in entries}
        return TensorStorage(tensors), kind
    if not torch.distributed.is_available():
        raise TransferError("torch backend: this torch build has no torch.distributed")
    if tensors is None:
        return FlatStorage(torch.empty(total, dtype=torch.uint8, device=device)), kind
    return FlatStorage(pack_flat(tensors, entries, total, device)), kind
