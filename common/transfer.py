"""Pull-model tensor transfer between worker processes: publish, descriptor, fetch, ack, free.

A sender ``publish``es named tensors under a transfer id and gets a small msgpack-able
descriptor; the control plane carries it to the receiver, whose ``fetch`` pulls the bytes over
the backend the descriptor names and acks, at which point the sender frees its copy. Unfetched
transfers are freed after ``ttl_s``. Every engine binds one ROUTER (``address``) served by a
background thread; ``fetch`` talks to it from a DEALER opened for that one call, so fetch is
safe to call from any thread and a late reply to an abandoned fetch can never be mistaken for
the answer to the next one.

Backends (the descriptor's ``backend``):
* ``shm``: one POSIX shared-memory segment per transfer; the receiver copies each tensor out
  (one copy, the result owns its memory) and the sender unlinks on the ack.
* ``tcp``: the sender's tensors go out as zero-copy zmq frames (the sender keeps references,
  so callers must not modify published tensors in place until release). The receiver's
  tensors alias the received zmq frames: memory the receiver alone owns, freed with the
  tensors; no extra copy is made.
* ``torch``: a 2-rank torch.distributed group per (sender, receiver) pair, created on first use
  and cached (gloo on CPU, NCCL on CUDA); handshake over zmq, bytes in one ``send`` of a flat
  uint8 buffer. The receiver's tensors are views into that one freshly allocated buffer.
* ``auto`` (publish side): stages into shm; a receiver on the same host (``host_id``) reads the
  segment, any other receiver is served the same bytes over tcp.

Descriptor (all msgpack-able)::

    {"v": 1, "id": transfer_id, "backend": "shm"|"tcp"|"torch"|"auto",
     "sender": worker_id, "instance": engine nonce, "address": "tcp://host:port",
     "host_id": "...", "nbytes": packed bytes,
     "tensors": [[name, dtype, shape, offset], ...],
     "shm": segment name (shm/auto only), "pg": "gloo"|"nccl" (torch only)}
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import zmq

from common import transfer_backends as tb
from common.serde import WireError
from common.sockets import bound_address, make_socket, recv, send
from common.transfer_backends import TransferError

__all__ = ["TransferEngine", "TransferError", "BACKENDS", "DEFAULT_TTL_S"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "shm", "tcp", "torch")
DESCRIPTOR_VERSION = 1
DEFAULT_TTL_S = 60.0
# How long the sender side waits for a receiver to join a new torch group / finish a send.
GROUP_TIMEOUT_S = 30.0
_POLL_MS = 50
# The ack is fire-and-forget on a socket closed right after; linger lets it leave the process.
_ACK_LINGER_MS = 1000


class _Msg(enum.IntEnum):
    # Private to the data-plane socket; the control plane's types live elsewhere.
    REQUEST = 1
    DATA = 2
    READY = 3
    ERROR = 4
    ACK = 5


# Which fetch modes each published backend can answer ("auto" stages in shm, serves both).
_SERVABLE = {"shm": ("shm",), "auto": ("shm", "tcp"), "tcp": ("tcp",), "torch": ("torch",)}


@dataclass
class _Published:
    storage: Any
    backend: str
    deadline: float


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


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
        self._stats: dict[str, Any] = {
            "published": 0, "served": 0, "acked": 0, "released": 0, "expired": 0,
            "fetched": 0, "fetch_errors": 0, "torch_groups": 0,
            "bytes_sent": {b: 0 for b in BACKENDS[1:]},
            "bytes_received": {b: 0 for b in BACKENDS[1:]},
        }
        count_group = lambda: self._count("torch_groups")  # noqa: E731
        self._torch_out = tb.TorchSender(host, GROUP_TIMEOUT_S, count_group)
        self._torch_in = tb.TorchReceiver(host, self.device, count_group)
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
        self._check_open()
        kind = backend or self.backend
        if kind not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already published")
        entries, total = tb.plan_layout(tensors)
        desc: dict[str, Any] = {
            "v": DESCRIPTOR_VERSION, "id": transfer_id, "sender": self.worker_id,
            "instance": self._instance, "address": self.address, "host_id": self.host_id,
            "nbytes": total, "tensors": tb.layout_to_wire(entries),
        }
        storage: Any
        if kind in ("shm", "auto"):
            try:
                storage = tb.ShmStorage(tensors, entries, total)
                desc["shm"] = storage.name
            except OSError as exc:
                if kind == "shm":
                    raise TransferError(f"cannot stage {total} B in shared memory: {exc}") from exc
                logger.warning("shm staging failed (%s); publishing %s over tcp", exc, transfer_id)
                kind = "tcp"
        if kind == "tcp":
            storage = tb.TensorStorage(tensors)
        elif kind == "torch":
            if not torch.distributed.is_available():
                raise TransferError("torch backend: this torch build has no torch.distributed")
            storage = tb.FlatStorage(tb.pack_flat(tensors, entries, total, self.device))
            desc["pg"] = "nccl" if storage.flat.is_cuda else "gloo"
        desc["backend"] = kind
        ttl = self.ttl_s if ttl_s is None else ttl_s
        with self._lock:
            duplicate = transfer_id in self._transfers  # lost a race with a concurrent publish
            if not duplicate:
                self._transfers[transfer_id] = _Published(storage, kind, time.monotonic() + ttl)
                self._stats["published"] += 1
        if duplicate:
            self._free(storage)
            raise ValueError(f"transfer {transfer_id!r} is already published")
        return desc

    def release(self, transfer_id: str) -> None:
        """Free a published transfer now (idempotent). The receiver's ack calls this."""
        with self._lock:
            pub = self._transfers.pop(transfer_id, None)
            if pub is not None:
                self._stats["released"] += 1
        if pub is not None:
            self._free(pub.storage)

    def pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def stats(self) -> dict:
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
            out["pending"] = len(self._transfers)
        out["worker_id"] = self.worker_id
        return out

    # ------------------------------------------------------------------ receiver API

    def fetch(self, descriptor: dict, timeout_s: float = 30.0) -> dict[str, torch.Tensor]:
        """Pull a published transfer, ack it, and return tensors this process owns (on
        ``device``). Raises TransferError within about ``timeout_s`` on any failure."""
        self._check_open()
        deadline = time.monotonic() + timeout_s
        try:
            out, mode, nbytes = self._fetch(descriptor, deadline)
        except TransferError:
            self._count("fetch_errors")
            raise
        with self._lock:
            self._stats["fetched"] += 1
            self._stats["bytes_received"][mode] += nbytes
        return out

    def _fetch(self, desc: dict, deadline: float) -> tuple[dict[str, torch.Tensor], str, int]:
        try:
            tid, address, backend = desc["id"], desc["address"], desc["backend"]
            entries = tb.layout_from_wire(desc["tensors"], desc["nbytes"])
            if desc.get("v") != DESCRIPTOR_VERSION or backend not in BACKENDS:
                raise ValueError(f"unsupported version/backend {desc.get('v')}/{backend}")
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed transfer descriptor: {exc!r}") from exc
        where = f"transfer {tid!r} from {desc.get('sender')!r} at {address}"
        mode = backend
        if backend == "auto":
            mode = "shm" if desc.get("host_id") == self.host_id else "tcp"
        try:
            dealer = make_socket(self._ctx, zmq.DEALER, connect=address, linger_ms=_ACK_LINGER_MS)
        except zmq.ZMQError as exc:
            raise TransferError(f"{where}: cannot connect: {exc}") from exc
        try:
            if mode == "torch":
                out = self._fetch_torch(dealer, desc, entries, where, deadline)
            else:
                reply = self._request(dealer, {"id": tid, "mode": mode}, where, deadline)
                if mode == "shm":
                    try:
                        out = tb.read_shm(desc["shm"], entries, desc["nbytes"], self.device)
                    except (OSError, ValueError) as exc:
                        if backend != "auto":
                            raise TransferError(
                                f"{where}: cannot read shared memory segment {desc.get('shm')!r} "
                                f"(sender host {desc.get('host_id')}, "
                                f"this host {self.host_id}): {exc}"
                            ) from exc
                        # Same host id but no visible segment (e.g. /dev/shm not shared): use tcp.
                        mode = "tcp"
                        reply = self._request(dealer, {"id": tid, "mode": mode}, where, deadline)
                if mode == "tcp":
                    out = self._check_tcp(reply, entries, where)
            self._send_nowait(dealer, _Msg.ACK, {"id": tid})
        finally:
            dealer.close()
        return out, mode, sum(e.nbytes for e in entries)

    def _check_tcp(
        self, body: Any, entries: list[tb.LayoutEntry], where: str
    ) -> dict[str, torch.Tensor]:
        tensors = body.get("t") if isinstance(body, dict) else None
        if not isinstance(tensors, dict) or list(tensors) != [e.name for e in entries]:
            raise TransferError(f"{where}: reply does not carry the described tensors")
        for e in entries:
            t = tensors[e.name]
            if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                got = f"{t.dtype}{list(t.shape)}"
                raise TransferError(f"{where}: tensor {e.name!r} arrived as {got}")
        if self.device != "cpu":
            tensors = {k: t.to(self.device) for k, t in tensors.items()}
        return tensors

    def _fetch_torch(
        self,
        dealer: zmq.Socket,
        desc: dict,
        entries: list[tb.LayoutEntry],
        where: str,
        deadline: float,
    ) -> dict[str, torch.Tensor]:
        def ask(gid: str | None) -> dict:
            body = {"id": desc["id"], "mode": "torch", "gid": gid, "peer": self._instance}
            return self._request(dealer, body, where, deadline)

        return self._torch_in.fetch(
            desc["instance"], desc.get("pg", "gloo"), desc["nbytes"], entries, ask, deadline, where
        )

    def _request(self, dealer: zmq.Socket, body: dict, where: str, deadline: float) -> Any:
        # IMMEDIATE on the DEALER means it is writable only once connected: a dead sender shows
        # up as "never writable" rather than as a request silently queued forever.
        if not dealer.poll(int(_remaining(deadline) * 1000), zmq.POLLOUT):
            raise TransferError(f"{where}: cannot connect to the sender (gone?) within the timeout")
        self._send_nowait(dealer, _Msg.REQUEST, body)
        if not dealer.poll(int(_remaining(deadline) * 1000), zmq.POLLIN):
            raise TransferError(f"{where}: no reply from the sender within the timeout")
        try:
            _, msg_type, reply = recv(dealer)
        except WireError as exc:
            raise TransferError(f"{where}: malformed reply: {exc}") from exc
        if msg_type == _Msg.ERROR:
            raise TransferError(f"{where}: {reply.get('error')}")
        if msg_type not in (_Msg.DATA, _Msg.READY) or not isinstance(reply, dict):
            raise TransferError(f"{where}: unexpected reply type {msg_type}")
        return reply

    @staticmethod
    def _send_nowait(
        sock: zmq.Socket, msg_type: int, body: Any, identity: bytes | None = None
    ) -> bool:
        try:
            send(sock, msg_type, body, identity=identity, flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError) as exc:  # peer gone or full: it will time out and retry
            logger.debug("data-plane send dropped: %s", exc)
            return False

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
                            error = {"error": "sender-side error, see its log"}
                            self._send_nowait(router, _Msg.ERROR, error, identity)
                self._reap()
        finally:
            router.close(linger=0)

    def _handle(self, router: zmq.Socket, identity: bytes, msg_type: int, body: Any) -> None:
        tid = body.get("id") if isinstance(body, dict) else None
        if msg_type == _Msg.ACK:
            with self._lock:
                known = tid in self._transfers
                self._stats["acked"] += known
            self.release(tid)
            return
        if msg_type != _Msg.REQUEST:
            return
        # Serve under the lock: a concurrent release() then either wins (the id is unknown) or
        # waits until the reply is queued, and the queued frames keep their memory alive.
        with self._lock:
            pub = self._transfers.get(tid)
            if pub is None:
                error = (f"unknown transfer id {tid!r} at {self.worker_id!r} "
                         "(never published, already fetched, or expired)")
                self._send_nowait(router, _Msg.ERROR, {"error": error}, identity)
                return
            mode = body.get("mode")
            if mode not in _SERVABLE[pub.backend]:
                error = f"transfer {tid!r} is {pub.backend}, cannot serve {mode!r}"
                self._send_nowait(router, _Msg.ERROR, {"error": error}, identity)
                return
            if mode == "shm":
                sent = self._send_nowait(router, _Msg.READY, {}, identity)
            elif mode == "tcp":
                sent = self._send_nowait(router, _Msg.DATA, {"t": pub.storage.tensors()}, identity)
            else:
                reply = self._torch_out.serve(
                    body.get("gid"), str(body.get("peer")), pub.storage.flat, tid
                )
                sent = self._send_nowait(router, _Msg.READY, reply, identity)
            if sent:
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

    def _free(self, storage: Any) -> None:
        if not storage.free():
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
        """Stop serving, free every pending transfer, drop groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        with self._lock:
            pending, self._transfers = list(self._transfers.values()), {}
        for pub in pending:
            self._free(pub.storage)
        for _ in range(20):  # zmq may still be flushing a frame that views a segment
            self._retry_unfreed()
            if not self._unfreed:
                break
            time.sleep(0.05)
        self._torch_out.close()
        self._torch_in.close()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
