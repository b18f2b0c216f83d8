"""L2 of the embedding cache: encoded images shared by every worker on one host, in tmpfs files.

An encode worker keeps its own LRU in memory (L1). Behind it, this store keeps each encoded image
as one file under a directory in /dev/shm, so an image encoded by one encoder is a hit for every
other encoder on the host, and for an encoder that restarts (the files outlive the process). The
Redis index (L3) says which hosts and workers hold which image across the cluster.

Files, not a shared-memory arena: a write goes to a temporary name and is renamed into place, so
a reader sees a whole entry or none, with no lock shared between processes; a reader that opened
a file keeps its bytes even if another process evicts (unlinks) it meanwhile. Least recently used
goes first: a hit touches the file's mtime, and a writer that takes the directory over its bound
unlinks the oldest entries. The directory is per model variant (the namespace), so two models, or
one model with and without visual-token pruning, never read each other's embeddings.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
import tempfile
import time
from dataclasses import dataclass

import torch

from mserve.common.hashing import host_member

__all__ = ["HostEmbeddingStore", "StoredEmbedding", "default_root", "host_member"]

log = logging.getLogger(__name__)

_MAGIC = b"MSEMB\x00\x00\x01"
_HEADER = struct.Struct("<8sIIQQqqq")  # magic, version, dtype, rows, cols, grid t/h/w (-1: none)
_HEADER_BYTES = 64
_VERSION = 1
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
_SUFFIX = ".emb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 60.0  # a temporary file this old was left by a writer that died mid-write


def default_root() -> str:
    """/dev/shm when the host has it (tmpfs: memory, shared by every process), else the temp dir."""
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), "mserve-embeddings")


@dataclass
class StoredEmbedding:
    embeds: torch.Tensor  # [num_visual_tokens, hidden]
    grid_thw: tuple[int, int, int] | None


class HostEmbeddingStore:
    def __init__(self, root: str, namespace: str, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.dir = os.path.join(root, hashlib.sha256(namespace.encode()).hexdigest()[:16])
        self.enabled = capacity_bytes > 0
        self.used_after_put = 0
        self._warned = False
        if self.enabled:
            try:
                os.makedirs(self.dir, exist_ok=True)
                with open(os.path.join(root, "README"), "w") as f:
                    f.write("MServe's host-wide embedding cache (L2); safe to delete when no worker runs.\n")
            except OSError as exc:
                log.warning("host embedding cache disabled: cannot use %s (%s)", self.dir, exc)
                self.enabled = False

    def _path(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad embedding key {key!r}")
        return os.path.join(self.dir, key + _SUFFIX)

    # -- read -----------------------------------------------------------------------------------------
    def get(self, key: str) -> StoredEmbedding | None:
        """The entry, or None (absent, evicted, or unreadable); a hit makes it the most recently used."""
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # LRU: a hit is recent use
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("host embedding cache: cannot read %s: %s", path, exc)
            return None
        if len(data) < _HEADER_BYTES:
            return None
        magic, version, dtype, rows, cols, t, h, w = _HEADER.unpack_from(data)
        dt = _DTYPE_OF.get(dtype)
        if magic != _MAGIC or version != _VERSION or dt is None:
            return None
        nbytes = rows * cols * torch.empty((), dtype=dt).element_size()
        if len(data) != _HEADER_BYTES + nbytes:
            return None  # truncated: cannot happen through rename, but never trust a file
        embeds = torch.frombuffer(bytearray(data[_HEADER_BYTES:]), dtype=dt).view(rows, cols)
        return StoredEmbedding(embeds, (t, h, w) if t >= 0 else None)

    def keys(self) -> list[str]:
        return [name[: -len(_SUFFIX)] for name, _, _ in self._entries()]

    # -- write ----------------------------------------------------------------------------------------
    def put(self, key: str, embeds: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> list[str]:
        """Store one entry (replacing any); returns the keys evicted to stay within the bound."""
        if not self.enabled or embeds.dtype not in _DTYPES or embeds.dim() != 2:
            return []
        body = embeds.detach().to("cpu").contiguous()
        size = _HEADER_BYTES + body.numel() * body.element_size()
        if size > self.capacity:
            return []
        t, h, w = grid_thw if grid_thw is not None else (-1, -1, -1)
        header = _HEADER.pack(_MAGIC, _VERSION, _DTYPES[body.dtype], body.shape[0], body.shape[1], t, h, w)
        tmp = os.path.join(self.dir, f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                f.write(header.ljust(_HEADER_BYTES, b"\0"))
                f.write(memoryview(body.view(torch.uint8).numpy()))
            os.replace(tmp, self._path(key))
        except OSError as exc:  # tmpfs full, or the directory went away
            if not self._warned:
                log.warning("host embedding cache: cannot write to %s (%s); entries that do not fit are skipped",
                            self.dir, exc)
                self._warned = True
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return []
        return self._evict()

    def _entries(self) -> list[tuple[str, int, int]]:
        """(file name, size, mtime_ns) of every entry; removes temporary files left by dead writers."""
        out = []
        now = time.time_ns()
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    if e.name.startswith(_TMP_PREFIX):
                        if now - st.st_mtime_ns > _STALE_TMP_S * 1e9:
                            _unlink(e.path)
                    elif e.name.endswith(_SUFFIX):
                        out.append((e.name, st.st_size, st.st_mtime_ns))
        except FileNotFoundError:
            return []
        return out

    def _evict(self) -> list[str]:
        entries = self._entries()
        used = sum(size for _, size, _ in entries)
        evicted = []
        for name, size, _ in sorted(entries, key=lambda e: e[2]):
            if used <= self.capacity:
                break
            if _unlink(os.path.join(self.dir, name)):
                evicted.append(name[: -len(_SUFFIX)])
            used -= size
        self.used_after_put = used  # the tier's bytes as this writer left it (every host worker writes it)
        return evicted

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def clear(self) -> None:
        for name, _, _ in self._entries():
            _unlink(os.path.join(self.dir, name))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:  # another worker evicted it first
        return False
