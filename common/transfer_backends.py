"""Byte movers behind common.transfer: layouts, shm segments, flat buffers, torch pair groups."""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import shared_memory
from typing import Any

import torch

try:  # POSIX only; the same module SharedMemory itself uses.
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms have no shm backend
    _posixshmem = None

__all__ = [
    "TransferError",
    "ALIGN",
    "DTYPES",
    "LayoutEntry",
    "host_id",
    "plan_layout",
    "layout_to_wire",
    "layout_from_wire",
    "ShmStorage",
    "TensorStorage",
    "FlatStorage",
    "read_shm",
    "pack_flat",
    "unpack_flat",
    "TorchSender",
    "TorchReceiver",
]

logger = logging.getLogger(__name__)

# 64 B keeps every tensor cache-line aligned and satisfies the alignment of every dtype below,
# so views into a segment or flat buffer never need a fix-up copy.
ALIGN = 64

# Same closed table as common.serde: a descriptor names dtypes, and a name must never be able
# to reach an arbitrary attribute of the torch module.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class TransferError(RuntimeError):
    """A fetch failed (sender gone, transfer unknown or expired, timeout, transport error).
    The transfer may be retried or re-routed; nothing was half-delivered to the caller."""


@dataclass(frozen=True)
class LayoutEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
    entries: list[LayoutEntry] = []
    offset = 0
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name!r}: unsupported dtype {t.dtype}")
        entry = LayoutEntry(name, t.dtype, tuple(t.shape), offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, offset


def layout_to_wire(entries: list[LayoutEntry]) -> list[list[Any]]:
    return [[e.name, _DTYPE_NAMES[e.dtype], list(e.shape), e.offset] for e in entries]


def layout_from_wire(wire: Any, total: int) -> list[LayoutEntry]:
    """Validate a descriptor's tensor list against the advertised buffer size."""
    if not isinstance(wire, list):
        raise ValueError("tensors must be a list")
    entries = []
    for item in wire:
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError(f"bad tensor entry {item!r}")
        name, dtype, shape, offset = item
        if not isinstance(name, str) or dtype not in DTYPES:
            raise ValueError(f"bad tensor entry {item!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"bad shape in {item!r}")
        entry = LayoutEntry(name, DTYPES[dtype], tuple(shape), offset)
        if not (isinstance(offset, int) and 0 <= offset and offset + entry.nbytes <= total):
            raise ValueError(f"tensor {name!r} lies outside the {total}-byte buffer")
        entries.append(entry)
    return entries


def _view(buf: Any, e: LayoutEntry) -> torch.Tensor:
    """A tensor aliasing ``e``'s bytes inside a writable buffer (no copy)."""
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)  # frombuffer rejects count=0
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
    return raw.view(e.dtype).view(e.shape)


# --------------------------------------------------------------------------- sender storages
# Each published transfer owns one storage until release; ``free`` returns False when the
# memory is still referenced (zmq has not finished sending views of it) and must be retried.


class TensorStorage:
    """tcp: the published tensors themselves (contiguous, CPU), served as zero-copy frames."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def free(self) -> bool:
        self._tensors = {}
        return True


class ShmStorage:
    """shm (and auto): every tensor copied into one POSIX segment at aligned offsets."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], entries: list[LayoutEntry], total: int
    ) -> None:
        # SharedMemory refuses size 0; a transfer of only empty tensors still needs a name.
        self._shm = shared_memory.SharedMemory(create=True, size=max(total, 1))
        self.name = self._shm.name
        self.nbytes = total
        self._entries = entries
        self._unlinked = False
        try:
            # Reserve the pages now: on a too-small /dev/shm (Docker's default is 64 MB) this
            # raises ENOSPC here instead of a SIGBUS on first touch while copying.
            os.posix_fallocate(self._shm._fd, 0, max(total, 1))
            for e in entries:
                if e.nbytes:
                    _view(self._shm.buf, e).copy_(tensors[e.name])
            if any(t.is_cuda for t in tensors.values()):
                torch.cuda.synchronize()
        except BaseException:
            self.free()
            raise

    def tensors(self) -> dict[str, torch.Tensor]:
        return {e.name: _view(self._shm.buf, e) for e in self._entries}

    def free(self) -> bool:
        if not self._unlinked:
            self._unlinked = True
            self._shm.unlink()  # also unregisters from this process's resource tracker
        try:
            self._shm.close()
        except BufferError:  # zmq still holds a frame viewing the segment
            return False
        return True


class FlatStorage:
    """torch: every tensor packed into one flat uint8 buffer, so a transfer is one send."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.nbytes = flat.numel()

    def free(self) -> bool:
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


def unpack_flat(flat: torch.Tensor, entries: list[LayoutEntry]) -> dict[str, torch.Tensor]:
    """Views into ``flat``: the tensors share (and keep alive) the one received buffer."""
    out = {}
    for e in entries:
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=e.dtype, device=flat.device)
        else:
            out[e.name] = flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
    return out


# --------------------------------------------------------------------------- receiver shm


def read_shm(
    name: str, entries: list[LayoutEntry], total: int, device: str
) -> dict[str, torch.Tensor]:
    """Copy the tensors out of another process's segment (one torch copy each), then unmap.

    Attaches with shm_open + mmap instead of ``SharedMemory(name)``: on Python 3.11 attaching
    registers the segment with the resource tracker, which spawned siblings share with their
    parent. Leaving it registered makes the tracker unlink it / warn "leaked shared_memory" at
    exit; unregistering it would delete the creator's registration too (KeyError in the tracker
    when the creator later unlinks). Not involving the tracker at all avoids both.
    """
    if _posixshmem is None:  # pragma: no cover
        raise OSError("POSIX shared memory is not available on this platform")
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size < total:
            raise ValueError(f"segment {name} has {size} bytes, descriptor says {total}")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    try:
        out = {}
        for e in entries:
            src = _view(mm, e)
            # clone on CPU, straight host->device copy otherwise: one copy either way.
            out[e.name] = src.clone() if device == "cpu" else src.to(device)
            del src  # views export the mapping; mm.close() refuses while any is alive
        return out
    finally:
        mm.close()


# --------------------------------------------------------------------------- torch pair groups


def _new_group(
    store: Any, gid: str, rank: int, pg_backend: str, timeout_s: float, own_host: str
) -> Any:
    """A 2-rank process group for one (sender, receiver) pair, without init_process_group (a
    worker talks to many peers, and the default group is a process-wide singleton).

    The PrefixStore keeps each pair's rendezvous keys apart on the sender's one TCPStore.
    Blocks until both ranks have joined or ``timeout_s`` passes.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"mserve/transfer/{gid}", store)
    if pg_backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Bind gloo where the zmq data plane binds, so a worker pinned to one interface stays on it.
    if own_host in ("", "0.0.0.0", "*", "::"):
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own_host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


@dataclass
class _PairOut:
    """Sender side of one pair group; ``ready`` is set once the group exists or failed."""

    gid: str
    peer: str
    ready: threading.Event = field(default_factory=threading.Event)
    pg: Any = None
    error: str | None = None
    next_tag: int = 1


class TorchSender:
    """Sender side of the torch backend: hosts the TCPStore (rank 0 of every pair), caches one
    group per receiver, and sends each transfer's flat buffer from its own thread, so the
    data-plane thread that calls ``serve`` never blocks on a peer."""

    def __init__(self, host: str, timeout_s: float, on_new_group: Callable[[], None]) -> None:
        self._host = host
        self._timeout_s = timeout_s
        self._on_new_group = on_new_group
        self._store: Any = None
        self._pairs: dict[str, _PairOut] = {}
        # Retired pairs stay referenced: destroying a group with an op in flight can block.
        self._graveyard: list[_PairOut] = []

    def serve(self, gid: str | None, peer: str, flat: torch.Tensor, tid: str) -> dict[str, Any]:
        """Start sending ``flat`` and return the reply telling the receiver how to recv it."""
        if flat.numel() == 0:
            return {"tag": None}
        if gid is not None:
            pair = self._pairs.get(gid)
            if pair is None or pair.error is not None:
                return {"stale": True}
        else:
            if self._store is None:
                import torch.distributed as dist

                # Port 0: the OS picks a free port and there is no bind race to lose.
                self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=self._timeout_s))
            # A receiver asks for a new group only after giving up its old one: retire ours too.
            for old in [g for g, p in self._pairs.items() if p.peer == peer]:
                self._graveyard.append(self._pairs.pop(old))
            pair = _PairOut(secrets.token_hex(8), peer)
            self._pairs[pair.gid] = pair
            backend = "nccl" if flat.is_cuda else "gloo"
            threading.Thread(target=self._create, args=(pair, backend), daemon=True,
                             name=f"transfer-pg-{pair.gid}").start()
        tag, pair.next_tag = pair.next_tag, pair.next_tag + 1
        # Unique tags keep concurrent transfers on one pair from matching each other's recv.
        threading.Thread(target=self._send, args=(pair, flat, tag, tid), daemon=True,
                         name=f"transfer-send-{tid}").start()
        return {"gid": pair.gid, "tag": tag, "store": [self._store.host, self._store.port]}

    def _create(self, pair: _PairOut, backend: str) -> None:
        try:
            pair.pg = _new_group(self._store, pair.gid, 0, backend, self._timeout_s, self._host)
            self._on_new_group()
        except Exception as exc:
            pair.error = str(exc)
            logger.warning("torch group with %s failed: %s", pair.peer, exc)
        finally:
            pair.ready.set()

    def _send(self, pair: _PairOut, flat: torch.Tensor, tag: int, tid: str) -> None:
        if not pair.ready.wait(self._timeout_s) or pair.error is not None:
            return
        if flat.is_cuda:
            torch.cuda.set_device(flat.device)
        try:
            pair.pg.send([flat], 1, tag).wait(timedelta(seconds=self._timeout_s))
        except Exception as exc:
            # Mark the group stale so the receiver's next request is told to build a new one.
            pair.error = str(exc)
            logger.warning("torch send of %s to %s failed: %s", tid, pair.peer, exc)

    def reap(self) -> None:
        """Retire failed groups (call from the thread that calls ``serve``)."""
        for gid in [g for g, p in self._pairs.items() if p.error is not None]:
            self._graveyard.append(self._pairs.pop(gid))

    def close(self) -> None:
        self._pairs.clear()
        self._graveyard.clear()
        self._store = None


class TorchReceiver:
    """Receiver side of the torch backend: one cached group per sender engine instance."""

    def __init__(self, host: str, device: str, on_new_group: Callable[[], None]) -> None:
        self._host = host
        self._device = device
        self._on_new_group = on_new_group
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[str, Any]] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self._graveyard: list[Any] = []

    def fetch(
        self,
        sender: str,
        pg_backend: str,
        nbytes: int,
        entries: list[LayoutEntry],
        ask: Callable[[str | None], dict[str, Any]],
        deadline: float,
        where: str,
    ) -> dict[str, torch.Tensor]:
        """``ask(gid)`` sends the request over the data plane and returns the sender's reply;
        ``where`` names the transfer in error messages."""
        nccl = pg_backend == "nccl"
        if nccl and not self._device.startswith("cuda"):
            raise TransferError(f"{where}: sender uses NCCL but this device is {self._device}")
        with self._lock:
            pair_lock = self._pair_locks.setdefault(sender, threading.Lock())
        # Serialize per sender so two first fetches don't build two groups.
        with pair_lock:
            gid, pg = self._pairs.get(sender, (None, None))
            reply = ask(gid)
            if reply.get("stale"):  # the sender retired our group after a failure: rebuild
                self._retire(sender)
                gid, pg = None, None
                reply = ask(None)
            tag = reply.get("tag")
            if tag is None:  # nothing to move: only empty tensors
                return unpack_flat(torch.empty(0, dtype=torch.uint8, device=self._device), entries)
            if pg is None:
                import torch.distributed as dist

                gid = reply["gid"]
                host, port = reply["store"]
                timeout_s = max(deadline - time.monotonic(), 0.1)
                try:
                    timeout = timedelta(seconds=timeout_s)
                    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
                    pg = _new_group(store, gid, 1, pg_backend, timeout_s, self._host)
                except Exception as exc:
                    raise TransferError(f"{where}: cannot join the torch group: {exc}") from exc
                with self._lock:
                    self._pairs[sender] = (gid, pg)
                self._on_new_group()
        # gloo moves host memory only; NCCL wants the buffer on this worker's GPU.
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self._device if nccl else "cpu")
        try:
            work = pg.recv([flat], 0, tag)
            if not work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001))):
                raise TimeoutError("recv did not complete in time")
        except Exception as exc:
            # After a failed op the group's state is unknown: the next transfer builds a new one.
            self._retire(sender)
            raise TransferError(f"{where}: torch recv failed: {exc}") from exc
        if flat.device != torch.device(self._device):
            flat = flat.to(self._device)
        return unpack_flat(flat, entries)

    def _retire(self, sender: str) -> None:
        with self._lock:
            dropped = self._pairs.pop(sender, None)
            if dropped is not None:
                self._graveyard.append(dropped[1])

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()
            self._graveyard.clear()
