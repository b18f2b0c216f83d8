"""Pull-model tensor transfer between worker processes: publish, descriptor, fetch, ack, free.

A sender ``publish``es named tensors under a transfer id and gets a small msgpack-able
descriptor; the control plane carries it to the receiver, whose ``fetch`` pulls the bytes over
the backend the descriptor names and acks, at which point the sender frees (or, for shm,
recycles) its copy. Unfetched transfers are freed after ``ttl_s``. Every engine binds one
ROUTER (``address``) served by a background thread; receivers talk to it from cached DEALERs
(mserve.common.transfer_channel), so fetch is safe to call from any thread. A descriptor is for one
receiver: a second fetch of it fails once the first is acked, and over tcp or shm a concurrent
second fetch makes the sender unlink rather than reuse the memory.

Two paths skip a copy each:
* ``alloc`` + ``publish_allocated``: the sender writes its tensors straight into what it will
  serve (a pooled shm segment), so publishing copies nothing.
* ``fetch_view`` (or ``fetch(copy=False)`` + ``release_fetched``): shm tensors are views of the
  sender's segment, valid until released; the ack, and with it the segment's reuse, waits for
  the release. ``fetch`` (copy=True) returns memory the receiver owns and acks at once.

Backends (the descriptor's ``backend``):
* ``shm``: a segment from the sender's bounded pool (mserve.common.shm_pool), reused after its
  receiver acks. The receiver sends nothing but that ack: it keeps its mapping of the segment
  and leases it with a shared flock while reading (mserve.common.shm_mappings), so a fetch is a few
  syscalls plus, with copy=True, one memcpy. Every other end of a transfer (expiry, an explicit
  ``release``, close) unlinks the segment rather than reusing it, so a receiver still reading
  it never sees its bytes change.
* ``tcp``: the sender's tensors go out as zero-copy zmq frames (the sender keeps references,
  so callers must not modify published tensors in place until release). The receiver's
  tensors alias the received zmq frames: memory the receiver alone owns; no extra copy is
  made, with or without ``copy``.
* ``torch``: a 2-rank torch.distributed group per (sender, receiver) pair, created on first use
  and cached (gloo on CPU, NCCL on CUDA); handshake over zmq, bytes in one ``send`` of a flat
  uint8 buffer. The receiver's tensors are views into that one freshly allocated buffer.
* ``auto`` (publish side): stages into shm; a receiver on the same host (``host_id``) reads the
  segment, any other receiver is served the same bytes over tcp.

Descriptor (all msgpack-able)::

    {"v": 2, "id": transfer_id, "backend": "shm"|"tcp"|"torch"|"auto",
     "sender": worker_id, "instance": engine nonce, "address": "tcp://host:port",
     "host_id": "...", "nbytes": packed bytes,
     "tensors": [[name, dtype, shape, offset], ...],
     "shm": segment name, "shm_nonce": int, "shm_gen": int (shm/auto only),
     "pg": "gloo"|"nccl" (torch only)}
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from mserve.common import transfer_backends as tb
from mserve.common.serde import WireError
from mserve.common.shm_pool import DEFAULT_POOL_BYTES, SegmentPool
from mserve.common.sockets import bound_address, make_socket, recv
from mserve.common.transfer_backends import TransferError
from mserve.common.transfer_channel import Msg, send_nowait
from mserve.common.transfer_fetch import Fetcher
from mserve.common.transfer_handles import Allocation, FetchedView
from mserve.common.transfer_torch import TorchSender

__all__ = [
    "TransferEngine", "TransferError", "FetchedView", "Allocation", "BACKENDS", "DEFAULT_TTL_S",
]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "shm", "tcp", "torch")
DESCRIPTOR_VERSION = 2
DEFAULT_TTL_S = 60.0
# How long the sender side waits for a receiver to join a new torch group / finish a send.
GROUP_TIMEOUT_S = 30.0
_POLL_MS = 50

# Which fetch requests each published backend answers ("auto" stages in shm, also serves tcp).
# shm is never requested: a receiver leases the segment itself (mserve.common.shm_mappings).
_SERVABLE = {"shm": (), "auto": ("tcp",), "tcp": ("tcp",), "torch": ("torch",)}


@dataclass
class _Published:
    storage: Any
    backend: str
    deadline: float
    served: int = 0  # > 1: several receivers may hold it, so it is unlinked, never reused


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
        self._transfers: dict[str, _Published] = {}
        self._unfreed: list[Any] = []  # storages whose memory zmq still references
        self._views: dict[str, FetchedView] = {}  # zero-copy fetches not yet released
        self._pool = SegmentPool(shm_pool_bytes)
        self._stats: dict[str, Any] = {
            "published": 0, "served": 0, "acked": 0, "released": 0, "expired": 0,
            "fetched": 0, "fetch_errors": 0, "torch_groups": 0,
            "bytes_sent": {b: 0 for b in BACKENDS[1:]},
            "bytes_received": {b: 0 for b in BACKENDS[1:]},
        }
        count_group = lambda: self._count("torch_groups")  # noqa: E731
        self._torch_out = TorchSender(host, GROUP_TIMEOUT_S, count_group)
        self._fetcher = Fetcher(
            self._ctx, host=host, device=self.device, host_id=self.host_id,
            instance=self._instance, descriptor_version=DESCRIPTOR_VERSION, backends=BACKENDS,
            on_new_group=count_group,
        )
        self._closed = False
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.address = ""
        self._thread = threading.Thread(
            target=self._serve, name=f"transfer-{worker_id}", daemon=True
        )
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise self._bind_error

    # ------------------------------------------------------------------ sender API

    def publish(
        self,
        transfer_id: str,
        tensors: dict[str, torch.Tensor],
        *,
        backend: str | None = None,
        ttl_s: float | None = None,
    ) -> dict:
        """Stage ``tensors`` for one fetch and return the descriptor to hand to the receiver.

        ``backend``/``ttl_s`` override the engine defaults for this transfer. shm and torch copy
        the tensors here; tcp keeps references (do not modify them in place until released).
        """
        kind = self._check_publish(transfer_id, backend)
        layout = tb.plan_layout(tensors)
        storage, kind = tb.stage(kind, layout, tensors, pool=self._pool, device=self.device)
        return self._register(transfer_id, storage, kind, layout, ttl_s)

    def alloc(
        self, spec: dict[str, tuple[Any, torch.dtype]], *, backend: str | None = None
    ) -> Allocation:
        """Writable tensors ``{name: (shape, dtype)}`` backed by what a transfer serves (a
        pooled shm segment for shm/auto), to fill and then ``publish_allocated``: the data is
        written once, with no staging copy at publish."""
        self._check_open()
        kind = self._check_backend(backend)
        layout = tb.plan_layout_spec(spec)
        storage, kind = tb.stage(kind, layout, None, pool=self._pool, device=self.device)
        if isinstance(storage, tb.FlatStorage):
            tensors = tb.unpack_flat(storage.flat, layout[0])
        else:
            tensors = storage.tensors()
        return Allocation(tensors, kind, storage, layout)

    def publish_allocated(
        self, transfer_id: str, allocation: Allocation, *, ttl_s: float | None = None
    ) -> dict:
        """Publish an ``alloc``ated transfer; the engine owns its memory from here on."""
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
        return self._register(transfer_id, storage, allocation.backend, allocation.layout, ttl_s)

    def release(self, transfer_id: str) -> None:
        """Free a published transfer now (idempotent). Its shm segment is unlinked, not reused:
        a receiver may still be reading it."""
        self._finish(transfer_id, acked=False)

    def pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def stats(self) -> dict:
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
            out["pending"] = len(self._transfers)
            out["views_open"] = len(self._views)
        out["shm_pool"] = self._pool.stats()
        out["shm_mapped"] = self._fetcher.stats()
        out["worker_id"] = self.worker_id
        return out

    def _check_backend(self, backend: str | None) -> str:
        kind = backend or self.backend
        if kind not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
        return kind

    def _check_publish(self, transfer_id: str, backend: str | None) -> str:
        self._check_open()
        kind = self._check_backend(backend)
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already published")
        return kind

    def _register(
        self, transfer_id: str, storage: Any, kind: str,
        layout: tuple[list[tb.LayoutEntry], int], ttl_s: float | None,
    ) -> dict:
        entries, total = layout
        desc: dict[str, Any] = {
            "v": DESCRIPTOR_VERSION, "id": transfer_id, "backend": kind, "sender": self.worker_id,
            "instance": self._instance, "address": self.address, "host_id": self.host_id,
            "nbytes": total, "tensors": tb.layout_to_wire(entries),
        }
        if isinstance(storage, tb.SegmentStorage):
            seg = storage.segment
            seg.tag(transfer_id)
            desc.update(shm=seg.name, shm_nonce=seg.nonce, shm_gen=seg.gen)
        elif kind == "torch":
            desc["pg"] = "nccl" if storage.flat.is_cuda else "gloo"
        ttl = self.ttl_s if ttl_s is None else ttl_s
        with self._lock:
            duplicate = transfer_id in self._transfers  # lost a race with a concurrent publish
            if not duplicate:
                pub = _Published(storage, kind, time.monotonic() + ttl)
                self._transfers[transfer_id] = pub
                self._stats["published"] += 1
        if duplicate:
            self._free(storage, recycle=True)  # nobody has seen it
            raise ValueError(f"transfer {transfer_id!r} is already published")
        return desc

    # ------------------------------------------------------------------ receiver API

    def fetch(
        self, descriptor: dict, timeout_s: float = 30.0, *, copy: bool = True
    ) -> dict[str, torch.Tensor]:
        """Pull a published transfer and return its tensors (on ``device``). Raises
        TransferError within about ``timeout_s`` on any failure.

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
        self, descriptor: dict, timeout_s: float = 30.0, *, copy: bool = False
    ) -> FetchedView:
        """Pull a transfer without copying it out of shared memory; release the returned
        handle (or leave its ``with`` block) when done with the tensors. (``copy=True`` is
        ``fetch``'s path: a handle whose tensors the receiver owns.)"""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        try:
            tid, tensors, mode, nbytes, ack = self._fetcher.fetch(descriptor, deadline, not copy)
        except TransferError:
            self._count("fetch_errors")
            raise
        with self._lock:
            self._stats["fetched"] += 1
            self._stats["bytes_received"][mode] += nbytes
        if ack is None:
            return FetchedView(tid, tensors, None)
        return FetchedView(tid, tensors, lambda: self._release_view(tid, ack))

    def release_fetched(self, descriptor: dict | str) -> None:
        """End a ``fetch(copy=False)``: the sender may reuse the memory (idempotent)."""
        tid = descriptor if isinstance(descriptor, str) else descriptor.get("id")
        with self._lock:
            view = self._views.pop(tid, None)
        if view is not None:
            view.release()

    def _release_view(self, tid: str, release: Any) -> None:
        with self._lock:
            self._views.pop(tid, None)
        release()  # drops the lease; the ack part is a no-op once the engine is closed

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        try:
            router = make_socket(self._ctx, zmq.ROUTER, bind=f"tcp://{self.host}:0")
            self.address = bound_address(router)
        except BaseException as exc:
            self._bind_error = exc
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if router.poll(_POLL_MS, zmq.POLLIN):
                    while True:
                        try:
                            identity, msg_type, body = recv(router, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except WireError as exc:
                            logger.warning("malformed data-plane message dropped: %s", exc)
                            continue
                        try:
                            self._handle(router, identity, msg_type, body)
                        except Exception:  # one bad request must not kill the data plane
                            logger.exception("data-plane request failed")
                            error = {"error": "sender-side error, see its log",
                                     "rq": body.get("rq") if isinstance(body, dict) else None}
                            send_nowait(router, Msg.ERROR, error, identity)
                self._reap()
        finally:
            router.close(linger=0)

    def _handle(self, router: zmq.Socket, identity: bytes, msg_type: int, body: Any) -> None:
        tid = body.get("id") if isinstance(body, dict) else None
        if msg_type == Msg.ACK:
            self._finish(tid, acked=True)
            return
        if msg_type != Msg.REQUEST:
            return
        rq = body.get("rq")
        # Serve under the lock: a concurrent release() then either wins (the id is unknown) or
        # waits until the reply is queued, and the queued frames keep their memory alive.
        with self._lock:
            pub = self._transfers.get(tid)
            if pub is None:
                error = (f"unknown transfer id {tid!r} at {self.worker_id!r} "
                         "(never published, already fetched, or expired)")
                send_nowait(router, Msg.ERROR, {"error": error, "rq": rq}, identity)
                return
            mode = body.get("mode")
            if mode not in _SERVABLE[pub.backend]:
                error = f"transfer {tid!r} is {pub.backend}, cannot serve {mode!r}"
                send_nowait(router, Msg.ERROR, {"error": error, "rq": rq}, identity)
                return
            if mode == "tcp":
                reply = {"t": pub.storage.tensors(), "rq": rq}
                sent = send_nowait(router, Msg.DATA, reply, identity)
            else:
                reply = self._torch_out.serve(
                    body.get("gid"), str(body.get("peer")), pub.storage.flat, tid
                )
                sent = send_nowait(router, Msg.READY, {**reply, "rq": rq}, identity)
            if sent:
                pub.served += 1
                self._stats["served"] += 1
                self._stats["bytes_sent"][mode] += pub.storage.nbytes

    def _finish(self, tid: Any, *, acked: bool) -> None:
        with self._lock:
            pub = self._transfers.pop(tid, None)
            if pub is not None:
                self._stats["released"] += 1
                self._stats["acked"] += acked
                if acked and not pub.served and isinstance(pub.storage, tb.SegmentStorage):
                    self._stats["served"] += 1  # read through shm: the ack is all we see
                    self._stats["bytes_sent"]["shm"] += pub.storage.nbytes
        if pub is not None:
            # Reuse the memory only once the receiver says it is done, and never after serving
            # it twice over tcp (the other receiver may still be reading). Over shm the segment
            # lock catches a second reader (mserve.common.shm_pool).
            self._free(pub.storage, recycle=acked and pub.served <= 1)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [tid for tid, p in self._transfers.items() if p.deadline <= now]
        self._torch_out.reap()
        for tid in expired:
            with self._lock:
                pub = self._transfers.pop(tid, None)
                if pub is not None:
                    self._stats["expired"] += 1
            if pub is not None:
                logger.warning("transfer %s expired unfetched; freed", tid)
                self._free(pub.storage)
        self._retry_unfreed()

    # ------------------------------------------------------------------ lifecycle

    def _free(self, storage: Any, recycle: bool = False) -> None:
        if not storage.free(recycle):
            with self._lock:
                self._unfreed.append(storage)

    def _retry_unfreed(self) -> None:
        with self._lock:
            pending, self._unfreed = self._unfreed, []
        for storage in pending:
            self._free(storage)

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
        self._stop.set()
        self._thread.join()
        with self._lock:
            pending, self._transfers = list(self._transfers.values()), {}
            self._views.clear()
        for pub in pending:
            self._free(pub.storage)
        with self._lock:
            self._unfreed.extend(self._pool.close())
        for _ in range(20):  # zmq may still be flushing a frame that views a segment
            self._retry_unfreed()
            if not self._unfreed:
                break
            time.sleep(0.05)
        self._fetcher.close()
        self._torch_out.close()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
