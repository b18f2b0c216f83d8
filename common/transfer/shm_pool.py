"""Reusable POSIX shared-memory segments, sender side: a bounded pool of pre-faulted segments.

Why a pool: creating, fallocating, faulting in and unlinking a 10 MiB segment for every transfer
cost ~3 ms, ten times the memcpy it exists for. Here a segment is created and pre-faulted once,
then handed out again and again (receivers keep their mappings too:
mserve.common.transfer.shm_mappings), so a steady-state transfer touches only warm pages.

Segment header (``HEADER`` bytes, then the data): ``nonce`` (random per segment creation),
``gen`` (bumped whenever the segment starts or stops holding a transfer) and ``tag`` (a hash of
the transfer id). A descriptor names all three; a receiver checks them under its lease, so a
fetch of a transfer that is over (acked, expired, released), of an id that was never published,
or through a stale mapping of a re-created segment fails instead of reading foreign bytes.

Leases instead of a round trip: a receiver holds a shared ``flock`` on the segment while it
reads (or holds views). The sender's reuse rule: a segment goes back to the pool only when its
receiver acked *and* an exclusive ``flock`` succeeds (nobody else, e.g. a duplicate fetch of the
same descriptor, still holds it); the header is re-stamped under that lock, so a receiver that
locks later sees the transfer is over. Every other end (expiry, explicit release, close) unlinks
the segment: unlinking never changes the bytes, and a receiver still mapping it keeps them.

Resource tracker: segments are created through ``SharedMemory`` (registered with this process's
tracker) and unlinked through it (which unregisters). Receivers attach with ``shm_open`` +
``mmap`` and never involve the tracker. The tracker does not save a worker killed with its
process group (kill -9 of a launcher's child takes the tracker too), and a pool would then leak
all of its segments, not just the ones in flight: segment names carry the creator's PID (and
PID namespace), and every new pool first unlinks segments whose creator is gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import struct
import threading
from multiprocessing import shared_memory
from typing import Any

import torch

__all__ = [
    "HEADER", "DEFAULT_POOL_BYTES", "size_class", "transfer_tag", "read_header", "owner_gone", "reap_orphans",
    "Segment", "SegmentPool",
]

logger = logging.getLogger(__name__)

HEADER = 64  # one cache line; keeps the data that follows 64-byte aligned
_HEADER_FMT = "<QQQ"  # nonce, gen, tag
DEFAULT_POOL_BYTES = 1 << 30
_MIN_CLASS = 64 << 10


_PREFIX = "mserve"
try:
    _PID_NS = f"{os.stat('/proc/self/ns/pid').st_ino:x}"
except OSError:  # no procfs: still unique per host, and orphans are then never reaped
    _PID_NS = "0"
_SHM_DIR = "/dev/shm"


def _segment_name() -> str:
    return f"{_PREFIX}_{_PID_NS}_{os.getpid()}_{secrets.token_hex(6)}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_gone(name: str) -> bool:
    """Whether a segment of ours (by its name, as `_segment_name` made it) was created by a process of this
    PID namespace that is gone; False for any other name."""
    parts = name.split("_")
    return (_PID_NS != "0" and len(parts) == 4 and parts[0] == _PREFIX and parts[1] == _PID_NS
            and parts[2].isdigit() and not pid_alive(int(parts[2])))


def reap_orphans() -> int:
    """Unlink segments whose creator (a process of this PID namespace) is gone; returns how
    many. A receiver still mapping one keeps its bytes; only the name goes away."""
    if _PID_NS == "0" or not os.path.isdir(_SHM_DIR):
        return 0
    reaped = 0
    for name in os.listdir(_SHM_DIR):
        if not owner_gone(name):
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            reaped += 1
        except FileNotFoundError:  # another process reaped it first
            pass
    if reaped:
        logger.warning("unlinked %d shared-memory segments left by dead processes", reaped)
    return reaped


def transfer_tag(transfer_id: str) -> int:
    """The header's 63-bit stand-in for a transfer id (both sides compute it)."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def read_header(buf: Any) -> tuple[int, int, int]:
    """(nonce, gen, tag) of a segment's mapping."""
    return struct.unpack_from(_HEADER_FMT, buf, 0)


def size_class(nbytes: int) -> int:
    """Capacity of the segment serving ``nbytes``: the next quarter power of two (at most 25%
    slack, few distinct sizes so segments are shared across requests of similar length)."""
    n = max(int(nbytes), _MIN_CLASS)
    base = 1 << ((n - 1).bit_length() - 1)  # base < n <= 2 * base
    step = base // 4
    return base + -(-(n - base) // step) * step


class Segment:
    """One shared-memory segment, owned by a ``SegmentPool``."""

    def __init__(self, capacity: int, pooled: bool) -> None:
        self.capacity = capacity
        self.pooled = pooled  # counted against the pool's bound; False: unlinked after one use
        self.nonce = secrets.randbits(63)
        self.gen = 0
        self._unlinked = False
        self._shm = shared_memory.SharedMemory(_segment_name(), create=True, size=HEADER + capacity)
        self.name = self._shm.name
        try:
            # Reserve the pages now: on a too-small /dev/shm (Docker's default is 64 MB) this
            # raises ENOSPC here instead of a SIGBUS on first touch while copying.
            os.posix_fallocate(self._shm._fd, 0, HEADER + capacity)
            # Fault every page into this process once, so no publish ever pays page faults.
            torch.frombuffer(self._shm.buf, dtype=torch.uint8).zero_()
        except BaseException:
            self.destroy()
            raise

    @property
    def buf(self) -> memoryview:
        return self._shm.buf

    def _write_header(self, tag: int) -> None:
        struct.pack_into(_HEADER_FMT, self._shm.buf, 0, self.nonce, self.gen, tag)

    def stamp(self) -> None:
        """Start holding a new transfer: a new ``gen``, no tag yet (see ``tag``)."""
        self.gen += 1
        self._write_header(0)

    def tag(self, transfer_id: str) -> None:
        """Name the transfer the segment now holds, before its descriptor goes out."""
        self._write_header(transfer_tag(transfer_id))

    def retire(self) -> None:
        """The transfer is over: from now on a receiver's header check fails. The data bytes
        are untouched, so views a receiver already holds stay valid."""
        if not self._unlinked:
            self.gen += 1
            self._write_header(0)

    def reclaim(self) -> bool:
        """Retire the transfer for reuse: True if no receiver holds a lease (shared flock) on
        the segment any more, which the exclusive lock proves; False means keep off it."""
        fd = self._shm._fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.retire()
            return False
        try:
            # Under the lock: a receiver that locks after this sees the new gen and backs off.
            self.retire()
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def free(self, recycle: bool = False) -> bool:
        """The storage protocol of mserve.common.transfer.backends, for retrying ``destroy``."""
        return self.destroy()

    def destroy(self) -> bool:
        """Unlink (once) and unmap; False while someone (zmq) still exports the mapping."""
        if not self._unlinked:
            self._unlinked = True
            self._shm.unlink()  # also unregisters from this process's resource tracker
        try:
            self._shm.close()
        except BufferError:
            return False
        return True


class SegmentPool:
    """Sender side: segments by size class, reused after their receiver is done.

    ``limit_bytes`` bounds what the pool *retains* (segments in use plus idle ones). When a new
    segment would exceed it, idle segments are unlinked, least recently used first; if every
    retained segment is in use, the transfer gets a one-off segment unlinked after its use.
    """

    def __init__(self, limit_bytes: int = DEFAULT_POOL_BYTES) -> None:
        reap_orphans()
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._idle: list[Segment] = []  # least recently returned first
        self._retained = 0
        self._closed = False
        self._stats = {"created": 0, "reused": 0, "recycled": 0, "unlinked": 0, "overflow": 0}

    def acquire(self, nbytes: int) -> Segment:
        """A stamped segment with room for ``nbytes`` of data. Raises OSError if /dev/shm is full."""
        cap = size_class(nbytes)
        evicted: list[Segment] = []
        seg = None
        with self._lock:
            if self._closed:
                raise RuntimeError("segment pool is closed")
            for i in range(len(self._idle) - 1, -1, -1):  # most recently used: warmest caches
                if self._idle[i].capacity == cap:
                    seg = self._idle.pop(i)
                    self._stats["reused"] += 1
                    break
            if seg is None:
                while self._idle and self._retained + cap > self.limit_bytes:
                    old = self._idle.pop(0)
                    self._retained -= old.capacity
                    evicted.append(old)
                pooled = self._retained + cap <= self.limit_bytes
                if pooled:
                    self._retained += cap
                else:
                    self._stats["overflow"] += 1
        for old in evicted:
            self._unlink(old)
        if seg is None:
            try:
                seg = Segment(cap, pooled)
            except BaseException:
                if pooled:
                    with self._lock:
                        self._retained -= cap
                raise
            with self._lock:
                self._stats["created"] += 1
        seg.stamp()
        return seg

    def recycle(self, seg: Segment) -> bool:
        """Its receiver acked: keep it for the next transfer if no lease is left on it, else
        (or for a one-off segment, or after close) unlink it. False: zmq still exports the
        sender's mapping; retry ``destroy``."""
        if seg.pooled and seg.reclaim():
            with self._lock:
                if not self._closed:
                    self._idle.append(seg)
                    self._stats["recycled"] += 1
                    return True
        return self.discard(seg)

    def discard(self, seg: Segment) -> bool:
        """Unlink now: never reused, so a receiver still reading it keeps valid bytes."""
        seg.retire()
        with self._lock:
            if seg.pooled:
                seg.pooled = False
                self._retained -= seg.capacity
        return self._unlink(seg)

    def _unlink(self, seg: Segment) -> bool:
        with self._lock:
            self._stats["unlinked"] += 1
        return seg.destroy()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "idle": len(self._idle), "retained_bytes": self._retained}

    def close(self) -> list[Segment]:
        """Unlink every idle segment; segments in use are unlinked when discarded/recycled.
        Returns the segments whose mapping is still exported (retry their ``destroy``)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._retained -= sum(s.capacity for s in idle)
        for s in idle:
            s.pooled = False
        return [s for s in idle if not self._unlink(s)]
