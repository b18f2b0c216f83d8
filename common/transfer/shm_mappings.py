"""Reusable POSIX shared-memory segments, receiver side: cached mappings and per-fetch leases.

A receiver maps each sender segment once and keeps the mapping (the sender reuses its segments,
mserve.common.transfer.shm_pool), so a fetch costs a few syscalls instead of an mmap plus a page
fault per 4 KiB.
Each fetch takes a ``Lease``: its own ``shm_open`` of the segment with a shared ``flock``, held
until the receiver is done with the bytes. The lock is what keeps the sender from reusing the
segment under a reader, without asking the sender anything (no round trip); the header check
under the lock is what proves the segment still holds the described transfer.

Stale mappings: the lease's descriptor is a fresh open of the name, so its inode says whether
the cached mapping is still of that file; a segment unlinked and re-created under the same name
is re-mapped instead of read through the old mapping.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from collections import OrderedDict

from mserve.common.transfer.shm_pool import DEFAULT_POOL_BYTES, HEADER, read_header, transfer_tag

try:  # POSIX only; the same module SharedMemory itself uses.
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms have no shm backend
    _posixshmem = None

__all__ = ["Lease", "MappingCache"]

# Mappings of unlinked segments are dropped at most this often: each check is an fstat per
# cached segment, and a mapping of an unlinked segment only pins memory, it is never wrong.
_SWEEP_EVERY_S = 0.25
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault pages in at map time


def _shm_open(name: str) -> int:
    if _posixshmem is None:  # pragma: no cover
        raise OSError("POSIX shared memory is not available on this platform")
    return _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)


class Lease:
    """A shared lock on one segment: the sender will not reuse it until ``release``."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __del__(self) -> None:  # an abandoned view must not pin the segment forever
        try:
            self.release()
        except OSError:
            pass


class _Mapping:
    def __init__(self, name: str) -> None:
        # An open file of its own (not shared with any lease: a lock belongs to the open file,
        # so sharing one would make a lease's unlock undo another's), kept to notice unlinking.
        self.fd = _shm_open(name)
        try:
            st = os.fstat(self.fd)
            self.ino, self.size = st.st_ino, st.st_size
            if self.size < HEADER:
                raise ValueError(f"segment {name} has only {self.size} bytes")
            self.mm: mmap.mmap | None = mmap.mmap(self.fd, self.size, flags=_MAP_FLAGS)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        # No mm.close(): another thread may have just been handed this mapping. Dropping our
        # reference unmaps it as soon as nobody (no tensor viewing it) holds it any more.
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
        self.mm = None


class MappingCache:
    """One mapping per sender segment, kept across fetches.

    Attaches with shm_open + mmap instead of ``SharedMemory(name)``: on Python 3.11 attaching
    registers the segment with the resource tracker, which spawned siblings share with their
    parent. Leaving it registered makes the tracker unlink it / warn "leaked shared_memory" at
    exit; unregistering it would delete the creator's registration too (KeyError in the tracker
    when the creator later unlinks). Not involving the tracker at all avoids both.

    Mappings of segments the sender unlinked are dropped (checked every ``_SWEEP_EVERY_S``)
    so they do not pin memory; ``limit_bytes`` bounds what stays mapped (LRU). Dropping a mapping
    never invalidates tensors viewing it: they keep the ``mmap`` object, and with it the pages.
    """

    def __init__(self, limit_bytes: int = 4 * DEFAULT_POOL_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._mapped = 0
        self._next_sweep = 0.0
        self.attached = 0  # segments mapped (cache misses)
        self.stale = 0  # cached mappings found to be of an unlinked, re-created segment

    def lease(
        self, name: str, nonce: int, gen: int, transfer_id: str, nbytes: int
    ) -> tuple[mmap.mmap, Lease]:
        """The mapping of segment ``name`` and a lease on it, provided its header says it holds
        ``transfer_id`` as (nonce, gen) with ``nbytes`` of data.

        Raises OSError if the segment cannot be opened (FileNotFoundError: it is gone) and
        ValueError if it holds something else (the transfer is over, or the id is wrong).
        """
        self._sweep()
        fd = _shm_open(name)
        lease = Lease(fd)
        try:
            ino = os.fstat(fd).st_ino
            mm = self._mapping(name, ino)
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while the sender re-stamps the header
            got_nonce, got_gen, got_tag = read_header(mm)
            if got_nonce != nonce or got_gen != gen or got_tag != transfer_tag(transfer_id):
                raise ValueError(
                    f"segment {name} holds ({got_nonce}, {got_gen}, {got_tag}), not transfer "
                    f"{transfer_id!r} as ({nonce}, {gen}): the transfer is over (already "
                    "fetched, freed or expired) or was never published there")
            if len(mm) < HEADER + nbytes:
                raise ValueError(f"segment {name} is too small for {nbytes} bytes")
            return mm, lease
        except BaseException:
            lease.release()
            raise

    def _mapping(self, name: str, ino: int) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(name)
            mm = m.mm if m is not None and m.ino == ino else None
            if mm is not None:
                self._maps.move_to_end(name)
                return mm  # ours to use even if another thread drops m right after
        if m is not None:  # the name now belongs to another file: unlinked and re-created
            self.stale += 1
            self._drop(name, m)
        m = _Mapping(name)
        if m.ino != ino:
            m.close()
            raise ValueError(f"segment {name} was replaced while being mapped")
        mm = m.mm
        with self._lock:
            self.attached += 1
            old = self._maps.pop(name, None)
            self._maps[name] = m
            self._mapped += m.size - (old.size if old else 0)
            evict = [old] if old else []
            while self._mapped > self.limit_bytes and len(self._maps) > 1:
                _, lru = self._maps.popitem(last=False)
                self._mapped -= lru.size
                evict.append(lru)
        for x in evict:
            x.close()
        return mm

    def _drop(self, name: str, m: _Mapping) -> None:
        with self._lock:
            if self._maps.get(name) is not m:  # another thread replaced or dropped it already
                return
            del self._maps[name]
            self._mapped -= m.size
        m.close()

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_EVERY_S
        with self._lock:
            items = list(self._maps.items())
        for name, m in items:
            try:
                gone = m.fd < 0 or os.fstat(m.fd).st_nlink == 0  # the sender unlinked it
            except OSError:
                gone = True
            if gone:
                self._drop(name, m)

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def close(self) -> None:
        with self._lock:
            maps, self._maps, self._mapped = list(self._maps.values()), OrderedDict(), 0
        for m in maps:
            m.close()
