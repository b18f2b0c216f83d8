"""torch.distributed pair groups behind the transfer engine's ``torch`` backend.

A 2-rank group per (sender, receiver) pair, created on first use and cached (gloo on CPU, NCCL
on CUDA); the handshake rides the zmq data plane, the bytes go in one ``send`` of a flat uint8
buffer (see ``backends.FlatStorage``). A receiver on the sender's own GPU, where NCCL cannot pair
them, copies the buffer through CUDA IPC instead (``cuda_ipc``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from mserve.common.cpu_placement import on_io_cores
from mserve.common.protocol.data_plane import TorchReady
from mserve.common.transfer import cuda_ipc
from mserve.common.transfer.backends import host_id, unpack_flat
from mserve.common.transfer.descriptor import LayoutEntry, TransferError

__all__ = ["TorchSender", "TorchReceiver"]

logger = logging.getLogger(__name__)


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
        self._gpus: dict[torch.device, str | None] = {}  # device -> cuda_ipc.gpu_identity

    def serve(
        self, gid: str | None, peer: str, flat: torch.Tensor, tid: str, gpu: str | None = None
    ) -> dict[str, Any]:
        """Start sending ``flat`` and return the reply telling the receiver how to recv it.
        ``gpu``: the receiver's GPU identity; if it is ``flat``'s own, the reply is a CUDA IPC
        handle (``flat`` stays alive until the transfer is acked or expires)."""
        if flat.numel() == 0:
            return {"tag": None}
        if gpu is not None and flat.is_cuda:
            if flat.device not in self._gpus:
                self._gpus[flat.device] = cuda_ipc.gpu_identity(flat.device, host_id())
            if gpu == self._gpus[flat.device]:
                return {"ipc": cuda_ipc.share(flat)}
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
        on_io_cores()
        try:
            pair.pg = _new_group(self._store, pair.gid, 0, backend, self._timeout_s, self._host)
            self._on_new_group()
        except Exception as exc:
            pair.error = str(exc)
            logger.warning("torch group with %s failed: %s", pair.peer, exc)
        finally:
            pair.ready.set()

    def _send(self, pair: _PairOut, flat: torch.Tensor, tag: int, tid: str) -> None:
        on_io_cores()
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
        # Sent with each request: a sender on this very GPU answers with a CUDA IPC handle.
        self.gpu = cuda_ipc.gpu_identity(device, host_id()) if device.startswith("cuda") else None
        self.ipc_fetches = 0
        self._ipc_senders: set[str] = set()
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[str, Any]] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self._graveyard: list[Any] = []

    def fetch(
        self,
        sender: str,
        pg_backend: str,
        nbytes: int,
        entries: Sequence[LayoutEntry],
        ask: Callable[[str | None], TorchReady],
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
            if reply.stale:  # the sender retired our group after a failure: rebuild
                self._retire(sender)
                gid, pg = None, None
                reply = ask(None)
            if reply.ipc is not None:
                return self._open_ipc(sender, reply.ipc, nbytes, entries, where)
            tag = reply.tag
            if tag is None:  # nothing to move: only empty tensors
                return unpack_flat(torch.empty(0, dtype=torch.uint8, device=self._device), entries)
            if pg is None:
                import torch.distributed as dist

                gid = reply.gid
                host, port = reply.store
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

    def _open_ipc(
        self, sender: str, parts: list[Any], nbytes: int, entries: Sequence[LayoutEntry], where: str
    ) -> dict[str, torch.Tensor]:
        if not self._device.startswith("cuda"):
            raise TransferError(f"{where}: the sender offered CUDA IPC but this device is {self._device}")
        try:
            flat = cuda_ipc.open_copy(parts, nbytes, self._device)
        except Exception as exc:
            raise TransferError(f"{where}: cannot copy through CUDA IPC: {exc}") from exc
        with self._lock:  # fetches from several senders run on their callers' threads
            self.ipc_fetches += 1
            first = sender not in self._ipc_senders
            self._ipc_senders.add(sender)
        if first:
            logger.info("torch transfers from %s use CUDA IPC (same GPU, %s)", sender, self.gpu)
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
