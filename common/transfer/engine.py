"""The transfer engine: pull-model tensor transfer between processes (publish, fetch, ack, free).

A sender ``publish``es named tensors under a transfer id and gets a small ``Descriptor``; the
control plane carries it to the receiver, whose ``fetch`` pulls the bytes over the backend the
descriptor names and acks, at which point the sender frees (or, for shm, recycles) its copy.
Unfetched transfers are freed after ``ttl_s``. Every engine binds one ROUTER (``address``)
served by a background thread; receivers talk to it from cached DEALERs
(mserve.common.transfer.channel), so fetch is safe to call from any thread. A descriptor is for
one receiver: a second fetch of it fails once the first is acked, and over tcp or shm a concurrent
second fetch makes the sender unlink rather than reuse the memory.

Two paths skip a copy each:
* ``alloc`` + ``publish_allocated``: the sender writes its tensors straight into what it will
  serve (a pooled shm segment), so publishing copies nothing.
* ``fetch_view`` (or ``fetch(copy=False)`` + ``release_fetched``): shm tensors are views of the
  sender's segment, valid until released; the ack, and with it the segment's reuse, waits for
  the release. ``fetch`` (copy=True) returns memory the receiver owns and acks at once.

Backends (the descriptor's ``backend``):
* ``shm``: a segment from the sender's bounded pool (mserve.common.transfer.shm_pool), reused
  after its receiver acks. The receiver sends nothing but that ack: it keeps its mapping of the
  segment and leases it with a shared flock while reading (mserve.common.transfer.shm_mappings),
  so a fetch is a few syscalls plus, with copy=True, one memcpy. Every other end of a transfer
  (expiry, an explicit ``release``, close) unlinks the segment rather than reusing it, so a
  receiver still reading it never sees its bytes change.
* ``tcp``: the sender's tensors go out as zero-copy zmq frames (the sender keeps references,
  so callers must not modify published tensors in place until release). The receiver's
  tensors alias the received zmq frames: memory the receiver alone owns; no extra copy is
  made, with or without ``copy``.
* ``torch``: a 2-rank torch.distributed group per (sender, receiver) pair, created on first use
  and cached (gloo on CPU, NCCL on CUDA); handshake over zmq, bytes in one ``send`` of a flat
  uint8 buffer. The receiver's tensors are views into that one freshly allocated buffer.
* ``auto`` (publish side): stages into shm; a receiver on the same host (``host_id``) reads the
  segment, any other receiver is served the same bytes over tcp.

Authentication (``curve``, mserve.common.security): the ROUTER becomes a CURVE server that admits
only the receivers whose public keys are in ``curve.authorized``, descriptors carry the engine's
public key (``key``), and fetches connect as CURVE clients with this engine's keypair. CURVE covers
the zmq messages (tcp data, torch and shm handshakes, acks), not the bytes the torch backend moves
over its own gloo/NCCL connections, nor shm segments (POSIX permissions: the same user only).

The descriptor (``Descriptor``, mserve.common.transfer.descriptor) is typed; ``to_wire()`` is the
msgpack-able dict the control plane carries, and the receiver side accepts either form.
The sender half (published transfers, the ROUTER thread) is mserve.common.transfer.server, the
receiver half mserve.common.transfer.fetch.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import torch
import zmq

from mserve.common.security import CurveKeys, Gate
from mserve.common.transfer import backends as tb
from mserve.common.transfer.descriptor import (
    BACKENDS, Descriptor, LayoutEntry, TransferError, as_descriptor,
)
from mserve.common.transfer.fetch import Fetcher
from mserve.common.transfer.handles import Allocation, FetchedView
from mserve.common.transfer.server import Server
from mserve.common.transfer.shm_pool import DEFAULT_POOL_BYTES

__all__ = ["TransferEngine", "DEFAULT_TTL_S"]

DEFAULT_TTL_S = 60.0


class TransferEngine:
    def __init__(
        self,
        worker_id: str,
        *,
        backend: str = "auto",
        host: str = "127.0.0.1",
        ctx: zmq.Context | None = None,
        device: str = "cpu",
        ttl_s: float = DEFAULT_TTL_S,
        shm_pool_bytes: int = DEFAULT_POOL_BYTES,
        curve: CurveKeys | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.worker_id = worker_id
        self.backend = backend
        self.host = host
        self.device = str(torch.device(device))
        self.ttl_s = ttl_s
        self.host_id = tb.host_id()
        self._instance = secrets.token_hex(8)  # tells a restarted worker_id apart
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._lock = threading.Lock()
        self._views: dict[str, FetchedView] = {}  # zero-copy fetches not yet released
        self._stats: dict[str, Any] = {
            "published": 0, "served": 0, "acked": 0, "released": 0, "expired": 0,
            "fetched": 0, "fetch_errors": 0, "torch_groups": 0,
            "bytes_sent": {b: 0 for b in BACKENDS[1:]},
            "bytes_received": {b: 0 for b in BACKENDS[1:]},
            "fetched_by": {b: 0 for b in BACKENDS[1:]},  # fetches per backend that moved them
        }
        count_group = lambda: self._count("torch_groups")  # noqa: E731
        self._fetcher = Fetcher(
            self._ctx, host=host, device=self.device, host_id=self.host_id,
            instance=self._instance, on_new_group=count_group, keys=curve,
        )
        self._closed = False
        # Before the ROUTER binds: from its first connection on, unknown peers are refused.
        self._gate = Gate(self._ctx, curve, f"data plane of {worker_id}") if curve is not None else None
        self.key = curve.public_text if curve is not None else None  # goes into every descriptor
        try:
            self._server = Server(
                self._ctx, name=worker_id, host=host, pool_bytes=shm_pool_bytes,
                lock=self._lock, stats=self._stats, on_new_group=count_group,
                curve=self._gate.apply if self._gate is not None else None,
            )
        except BaseException:
            self._fetcher.close()
            if self._gate is not None:
                self._gate.close()
            raise
        self.address = self._server.address

    # ------------------------------------------------------------------ sender API

    def publish(
        self,
        transfer_id: str,
        tensors: dict[str, torch.Tensor],
        *,
        backend: str | None = None,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> Descriptor:
        """Stage ``tensors`` for one fetch and return the descriptor to hand to the receiver
        (over the control plane: ``to_wire()``).

        ``backend``/``ttl_s`` override the engine defaults for this transfer. shm and torch copy
        the tensors here; tcp keeps references (do not modify them in place until released).
        ``shared``: for any number of fetches, by any receivers, until released or expired (a
        media store's items); its shm segment is never recycled, only unlinked.
        """
        kind = self._check_publish(transfer_id, backend)
        layout = tb.plan_layout(tensors)
        storage, kind = tb.stage(kind, layout, tensors, pool=self._server.pool, device=self.device)
        return self._register(transfer_id, storage, kind, layout, ttl_s, shared)

    def alloc(
        self, spec: dict[str, tuple[Any, torch.dtype]], *, backend: str | None = None
    ) -> Allocation:
        """Writable tensors ``{name: (shape, dtype)}`` backed by what a transfer serves (a
        pooled shm segment for shm/auto), to fill and then ``publish_allocated``: the data is
        written once, with no staging copy at publish."""
        self._check_open()
        kind = self._check_backend(backend)
        layout = tb.plan_layout_spec(spec)
        storage, kind = tb.stage(kind, layout, None, pool=self._server.pool, device=self.device)
        if isinstance(storage, tb.FlatStorage):
            tensors = tb.unpack_flat(storage.flat, layout[0])
        else:
            tensors = storage.tensors()
        return Allocation(tensors, kind, storage, layout)

    def publish_allocated(
        self, transfer_id: str, allocation: Allocation, *, ttl_s: float | None = None, shared: bool = False
    ) -> Descriptor:
        """Publish an ``alloc``ated transfer; the engine owns its memory from here on. ``shared``: as
        ``publish``'s."""
        if allocation.published:
            raise ValueError("allocation was already published or freed")
        self._check_publish(transfer_id, allocation.backend)
        storage = allocation.storage
        if isinstance(storage, tb.FlatStorage) and storage.flat.is_cuda:
            # The send runs on another thread's stream; make the caller's writes visible to it.
            torch.cuda.current_stream(storage.flat.device).synchronize()
        elif any(t.is_cuda for t in allocation.tensors.values()):  # pragma: no cover
            torch.cuda.synchronize()
        allocation.published = True
        allocation.tensors = {}
        return self._register(transfer_id, storage, allocation.backend, allocation.layout, ttl_s, shared)

    def release(self, transfer_id: str) -> None:
        """Free a published transfer now (idempotent). Its shm segment is unlinked, not reused:
        a receiver may still be reading it."""
        self._server.finish(transfer_id, acked=False)

    def pending(self) -> int:
        return self._server.pending()

    def stats(self) -> dict:
        pending = self._server.pending()
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
            out["pending"] = pending
            out["views_open"] = len(self._views)
        out["shm_pool"] = self._server.pool.stats()
        out["shm_mapped"] = self._fetcher.stats()
        out["cuda_ipc_fetches"] = self._fetcher.cuda_ipc_fetches
        out["worker_id"] = self.worker_id
        return out

    def counters(self) -> dict[str, int]:
        """Flat per-backend counters for a worker's heartbeat: transfers this engine fetched and
        bytes it served, by the backend that moved them (``auto`` resolves to shm or tcp)."""
        with self._lock:
            out = {f"transfer_fetched_{b}": n for b, n in self._stats["fetched_by"].items()}
            out.update({f"transfer_sent_bytes_{b}": n for b, n in self._stats["bytes_sent"].items()})
        return out

    def _check_backend(self, backend: str | None) -> str:
        kind = backend or self.backend
        if kind not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
        return kind

    def _check_publish(self, transfer_id: str, backend: str | None) -> str:
        self._check_open()
        if not isinstance(transfer_id, str):
            raise TypeError(f"transfer ids must be str, got {transfer_id!r}")
        kind = self._check_backend(backend)
        self._server.check_new(transfer_id)
        return kind

    def _register(
        self, transfer_id: str, storage: Any, kind: str,
        layout: tuple[list[LayoutEntry], int], ttl_s: float | None, shared: bool = False,
    ) -> Descriptor:
        if shared and kind == "torch":
            raise ValueError("a shared transfer is served over shm or tcp, not torch")
        entries, total = layout
        shm: dict[str, Any] = {}
        pg = None
        if isinstance(storage, tb.SegmentStorage):
            seg = storage.segment
            seg.tag(transfer_id)
            shm = {"shm": seg.name, "shm_nonce": seg.nonce, "shm_gen": seg.gen}
        elif kind == "torch":
            pg = "nccl" if storage.flat.is_cuda else "gloo"
        desc = Descriptor(
            id=transfer_id, backend=kind, sender=self.worker_id, instance=self._instance,
            address=self.address, host_id=self.host_id, nbytes=total, tensors=tuple(entries),
            pg=pg, key=self.key, shared=shared, **shm,
        )
        self._server.add(transfer_id, storage, kind, self.ttl_s if ttl_s is None else ttl_s, shared)
        return desc

    # ------------------------------------------------------------------ receiver API

    def fetch(
        self, descriptor: Descriptor | dict, timeout_s: float = 30.0, *, copy: bool = True
    ) -> dict[str, torch.Tensor]:
        """Pull a published transfer and return its tensors (on ``device``). Raises
        TransferError within about ``timeout_s`` on any failure, a malformed wire dict included.

        ``copy=True``: the tensors are this process's own memory; the sender is acked at once.
        ``copy=False``: shm tensors are views of the sender's segment, valid until
        ``release_fetched(descriptor)`` (which acks); see ``fetch_view``.
        """
        view = self.fetch_view(descriptor, timeout_s, copy=copy)
        if view.zero_copy:
            with self._lock:
                self._views[view.transfer_id] = view
        return view.tensors

    def fetch_view(
        self, descriptor: Descriptor | dict, timeout_s: float = 30.0, *, copy: bool = False
    ) -> FetchedView:
        """Pull a transfer without copying it out of shared memory; release the returned
        handle (or leave its ``with`` block) when done with the tensors. (``copy=True`` is
        ``fetch``'s path: a handle whose tensors the receiver owns.)"""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        try:
            desc = as_descriptor(descriptor)
            tid, tensors, mode, nbytes, ack = self._fetcher.fetch(desc, deadline, not copy)
        except TransferError:
            self._count("fetch_errors")
            raise
        with self._lock:
            self._stats["fetched"] += 1
            self._stats["fetched_by"][mode] += 1
            self._stats["bytes_received"][mode] += nbytes
        if ack is None:
            return FetchedView(tid, tensors, None)
        return FetchedView(tid, tensors, lambda: self._release_view(tid, ack))

    def release_fetched(self, descriptor: Descriptor | dict | str) -> None:
        """End a ``fetch(copy=False)``: the sender may reuse the memory (idempotent).
        ``descriptor`` may also be just the transfer id."""
        tid = descriptor if isinstance(descriptor, str) else as_descriptor(descriptor).id
        with self._lock:
            view = self._views.pop(tid, None)
        if view is not None:
            view.release()

    def _release_view(self, tid: str, release: Any) -> None:
        with self._lock:
            self._views.pop(tid, None)
        release()  # drops the lease; the ack part is a no-op once the engine is closed

    # ------------------------------------------------------------------ lifecycle

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TransferEngine {self.worker_id!r} is closed")

    def close(self) -> None:
        """Stop serving, unlink every segment, drop groups and sockets. Idempotent.

        Views still held are not acked (their senders expire them, unlinking rather than
        reusing the memory), so a late reader of one never sees its bytes change."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        with self._lock:
            self._views.clear()
        self._fetcher.close()
        if self._gate is not None:
            self._gate.close()  # its ZAP thread's sockets would hold up ctx.term()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
