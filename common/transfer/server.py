"""The sender half of the transfer engine: published transfers and the thread that serves them.

One ``Server`` per engine binds the engine's data-plane ROUTER and runs it on a background
thread: it answers fetch requests (tcp frames, torch sends), takes acks, and frees expired
transfers. Freeing recycles an acked shm segment into the pool (mserve.common.transfer.shm_pool)
and unlinks it on every other end of a transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from mserve.common.cpu_placement import on_io_cores
from mserve.common.protocol import ProtocolError
from mserve.common.protocol.data_plane import (TO_SENDER, Ack, FetchFailed, FetchRequest, TensorData, TorchReady,
                                               parse_data)
from mserve.common.serde import WireError
from mserve.common.sockets import bound_address, make_socket, recv
from mserve.common.transfer import backends as tb
from mserve.common.transfer.channel import Msg, send_nowait
from mserve.common.transfer.shm_pool import SegmentPool
from mserve.common.transfer.torch_pairs import TorchSender

__all__ = ["Server", "GROUP_TIMEOUT_S"]

logger = logging.getLogger(__name__)

# How long the sender side waits for a receiver to join a new torch group / finish a send.
GROUP_TIMEOUT_S = 30.0
_POLL_MS = 50

# Which fetch requests each published backend answers ("auto" stages in shm, also serves tcp).
# shm is never requested: a receiver leases the segment itself (transfer.shm_mappings).
_SERVABLE = {"shm": (), "auto": ("tcp",), "tcp": ("tcp",), "torch": ("torch",)}


@dataclass
class _Published:
    storage: Any
    backend: str
    deadline: float
    served: int = 0  # > 1: several receivers may hold it, so it is unlinked, never reused
    shared: bool = False  # many receivers: an ack does not end it (Descriptor.shared)


class Server:
    """The published transfers of one engine, served from a background thread.

    ``lock`` and ``stats`` are the engine's: the server counts into the same table under the
    same lock (``published``, ``served``, ``acked``, ``released``, ``expired``, ``bytes_sent``,
    ``torch_groups``)."""

    def __init__(
        self, ctx: zmq.Context, *, name: str, host: str, pool_bytes: int,
        lock: threading.Lock, stats: dict[str, Any], on_new_group: Callable[[], None],
        curve: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        self.name = name
        self._curve = curve  # makes the ROUTER a CURVE server (mserve.common.security.Gate.apply)
        self.host = host
        self.pool = SegmentPool(pool_bytes)
        self._ctx = ctx
        self._lock = lock
        self._stats = stats
        self._transfers: dict[str, _Published] = {}
        self._unfreed: list[Any] = []  # storages whose memory zmq still references
        self._torch_out = TorchSender(host, GROUP_TIMEOUT_S, on_new_group)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.address = ""
        self._thread = threading.Thread(target=self._serve, name=f"transfer-{name}", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise self._bind_error

    # ------------------------------------------------------------------ the engine's side

    def check_new(self, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already published")

    def add(self, transfer_id: str, storage: Any, kind: str, ttl_s: float, shared: bool = False) -> None:
        """Start serving ``storage`` until it is acked (unless ``shared``), released or ``ttl_s`` passes."""
        with self._lock:
            duplicate = transfer_id in self._transfers  # lost a race with a concurrent publish
            if not duplicate:
                pub = _Published(storage, kind, time.monotonic() + ttl_s, shared=shared)
                self._transfers[transfer_id] = pub
                self._stats["published"] += 1
        if duplicate:
            self._free(storage, recycle=True)  # nobody has seen it
            raise ValueError(f"transfer {transfer_id!r} is already published")

    def pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def finish(self, tid: Any, *, acked: bool) -> None:
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
            # lock catches a second reader (mserve.common.transfer.shm_pool).
            self._free(pub.storage, recycle=acked and pub.served <= 1 and not pub.shared)

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        on_io_cores()  # a worker's IO cores, where it has them (common/cpu_placement.py)
        try:
            router = make_socket(self._ctx, zmq.ROUTER, bind=f"tcp://{self.host}:0", curve=self._curve)
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
                            error = FetchFailed(error="sender-side error, see its log", rq=_rq_of(body))
                            send_nowait(router, Msg.ERROR, error.to_body(), identity)
                self._reap()
        finally:
            router.close(linger=0)

    def _handle(self, router: zmq.Socket, identity: bytes, msg_type: int, body: Any) -> None:
        try:
            msg = parse_data(msg_type, body, TO_SENDER)
        except ProtocolError as exc:
            logger.warning("bad data-plane message: %s", exc)
            if msg_type == Msg.REQUEST:
                send_nowait(router, Msg.ERROR, FetchFailed(error=str(exc), rq=_rq_of(body)).to_body(), identity)
            return
        if isinstance(msg, Ack):
            with self._lock:
                pub = self._transfers.get(msg.id)
                if pub is not None and pub.shared:  # read once more; it stays for the next receiver
                    self._stats["acked"] += 1
                    if isinstance(pub.storage, tb.SegmentStorage):
                        self._stats["served"] += 1
                        self._stats["bytes_sent"]["shm"] += pub.storage.nbytes
                    return
            self.finish(msg.id, acked=True)
            return
        assert isinstance(msg, FetchRequest)
        tid, rq = msg.id, msg.rq
        # Serve under the lock: a concurrent release() then either wins (the id is unknown) or
        # waits until the reply is queued, and the queued frames keep their memory alive.
        with self._lock:
            pub = self._transfers.get(tid)
            if pub is None:
                error = (f"unknown transfer id {tid!r} at {self.name!r} "
                         "(never published, already fetched, or expired)")
                send_nowait(router, Msg.ERROR, FetchFailed(error=error, rq=rq).to_body(), identity)
                return
            mode = msg.mode
            if mode not in _SERVABLE[pub.backend]:
                error = f"transfer {tid!r} is {pub.backend}, cannot serve {mode!r}"
                send_nowait(router, Msg.ERROR, FetchFailed(error=error, rq=rq).to_body(), identity)
                return
            if mode == "tcp":
                sent = send_nowait(router, Msg.DATA, TensorData(t=pub.storage.tensors(), rq=rq).to_body(), identity)
            else:
                ready = self._torch_out.serve(msg.gid, str(msg.peer), pub.storage.flat, tid, msg.gpu)
                sent = send_nowait(router, Msg.READY, TorchReady(rq=rq, **ready).to_body(), identity)
            if sent:
                pub.served += 1
                self._stats["served"] += 1
                self._stats["bytes_sent"][mode] += pub.storage.nbytes

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

    def close(self) -> None:
        """Stop the thread, then unlink every segment (pending or pooled) and drop groups."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            pending, self._transfers = list(self._transfers.values()), {}
        for pub in pending:
            self._free(pub.storage)
        with self._lock:
            self._unfreed.extend(self.pool.close())
        for _ in range(20):  # zmq may still be flushing a frame that views a segment
            self._retry_unfreed()
            if not self._unfreed:
                break
            time.sleep(0.05)
        self._torch_out.close()


def _rq_of(body: Any) -> int | None:
    """The request number of a body that did not parse, to echo in the error (None if it has none)."""
    rq = body.get("rq") if isinstance(body, dict) else None
    return rq if type(rq) is int else None
