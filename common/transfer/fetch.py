"""The receiver half of the transfer engine: resolve a descriptor, pull its bytes, say when to ack.

Kept apart from the engine because it is the one place that knows how each backend's bytes
reach this process: shm through a leased, cached mapping of the sender's segment (views, or one
copy out; no message to the sender but the ack), tcp as zmq frames the receiver owns (one
request), torch through a cached pair group (or CUDA IPC, when both are on one GPU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

from mserve.common.protocol.data_plane import FetchRequest, TensorData, TorchReady
from mserve.common.security import CurveKeys
from mserve.common.transfer import backends as tb
from mserve.common.transfer.channel import Channels
from mserve.common.transfer.descriptor import Descriptor, LayoutEntry, TransferError
from mserve.common.transfer.shm_mappings import MappingCache
from mserve.common.transfer.shm_pool import owner_gone
from mserve.common.transfer.torch_pairs import TorchReceiver

__all__ = ["Fetcher", "Fetched"]

# (transfer id, tensors, mode used, payload bytes, ack to send once the caller is done with
# the tensors, or None when the sender was acked already)
Fetched = tuple[str, dict[str, torch.Tensor], str, int, Callable[[], None] | None]

# How many shm publications a receiver remembers having acked. The sender frees a segment when
# the ack lands, which is asynchronous; remembering the ack makes a second fetch of the same
# publication fail at once instead of racing the sender's free.
_ACKED_MEMORY = 4096


class Fetcher:
    def __init__(
        self, ctx: zmq.Context, *, host: str, device: str, host_id: str, instance: str,
        on_new_group: Callable[[], None], keys: CurveKeys | None = None,
    ) -> None:
        self.device = device
        self.host_id = host_id
        self._instance = instance
        self.maps = MappingCache()
        self.channels = Channels(ctx, keys)
        self._torch_in = TorchReceiver(host, device, on_new_group)
        self._acked: OrderedDict[tuple[str, int, int], None] = OrderedDict()

    def _remember_ack(self, key: tuple[str, int, int]) -> None:
        self._acked[key] = None
        while len(self._acked) > _ACKED_MEMORY:
            self._acked.popitem(last=False)

    def fetch(self, desc: Descriptor, deadline: float, view: bool) -> Fetched:
        """Pull one transfer. ``view``: leave shm tensors as views of the sender's segment and
        return the ack for the caller to send when done; otherwise ack before returning."""
        tid, address, backend = desc.id, desc.address, desc.backend
        where = f"transfer {tid!r} from {desc.sender!r} at {address}"
        nbytes = desc.payload_nbytes
        self._check_curve(desc, where)
        mode = backend
        if backend == "auto":
            mode = "shm" if desc.host_id == self.host_id else "tcp"
        ack = lambda: self.channels.ack(address, tid, desc.key)  # noqa: E731
        if mode == "torch":
            out = self._fetch_torch(desc, where, deadline)
            ack()
            return tid, out, mode, nbytes, None
        if mode == "shm":
            # No round trip: the lease (a shared flock on the segment) keeps the sender off it,
            # the header under the lease proves it still holds this transfer.
            key = (str(desc.shm), int(desc.shm_nonce or 0), int(desc.shm_gen or 0))
            if key in self._acked and not desc.shared:
                raise TransferError(
                    f"{where}: unknown transfer id {tid!r}: already fetched and acked here")
            shm_ack = ack

            def ack() -> None:
                if not desc.shared:  # a shared transfer may be read again
                    self._remember_ack(key)
                shm_ack()

            try:
                mm, lease = self.maps.lease(desc.shm, desc.shm_nonce, desc.shm_gen, tid,
                                            desc.nbytes)
            except ValueError as exc:
                raise TransferError(f"{where}: unknown transfer id {tid!r}: {exc}") from exc
            except OSError as exc:
                if owner_gone(str(desc.shm)):
                    # Its sender was killed and a sweep unlinked its segments: nothing serves it over tcp
                    # either, so say so now rather than wait out the timeout for a connection.
                    raise TransferError(f"{where}: its sender's process is gone and its shared memory segment "
                                        f"{desc.shm!r} was swept with it") from exc
                if backend != "auto":
                    raise TransferError(
                        f"{where}: cannot open shared memory segment {desc.shm!r}: unknown "
                        "transfer id (already fetched, freed or expired) or a /dev/shm not "
                        f"shared with the sender (sender host {desc.host_id}, this host "
                        f"{self.host_id}): {exc}") from exc
                # Same host id but no visible segment (e.g. /dev/shm not shared): use tcp.
                mode = "tcp"
            else:
                out = tb.segment_views(mm, desc.tensors)
                del mm
                if view and self.device == "cpu":
                    def release() -> None:
                        lease.release()  # first: the ack may make the sender reclaim at once
                        ack()

                    return tid, out, mode, nbytes, release
                try:  # one copy: clone on CPU, straight host->device otherwise
                    out = {k: t.clone() if self.device == "cpu" else t.to(self.device)
                           for k, t in out.items()}
                finally:
                    lease.release()
                ack()
                return tid, out, mode, nbytes, None
        reply = self.channels.request(address, FetchRequest(id=tid, mode="tcp"), where, deadline, desc.key)
        out = self._check_tcp(reply, desc.tensors, where)
        ack()
        return tid, out, "tcp", nbytes, None

    def _check_curve(self, desc: Descriptor, where: str) -> None:
        """Both ends use CURVE or neither does: a receiver with keys never talks in the clear."""
        if desc.key is not None and self.channels.keys is None:
            raise TransferError(f"{where}: the sender's data plane requires CURVE (its descriptor carries a "
                                "public key) but this engine has no keypair (curve_secret_key)")
        if desc.key is None and self.channels.keys is not None:
            raise TransferError(f"{where}: the sender's data plane is not CURVE-protected (its descriptor "
                                "carries no public key); this engine refuses unauthenticated peers")

    def _check_tcp(
        self, body: Any, entries: Sequence[LayoutEntry], where: str
    ) -> dict[str, torch.Tensor]:
        tensors = body.t if isinstance(body, TensorData) else None
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
        self, desc: Descriptor, where: str, deadline: float
    ) -> dict[str, torch.Tensor]:
        def ask(gid: str | None) -> TorchReady:
            req = FetchRequest(id=desc.id, mode="torch", gid=gid, peer=self._instance, gpu=self._torch_in.gpu)
            reply = self.channels.request(desc.address, req, where, deadline, desc.key)
            if not isinstance(reply, TorchReady):
                raise TransferError(f"{where}: unexpected reply type {reply.KIND.name} to a torch fetch")
            return reply

        return self._torch_in.fetch(
            desc.instance, desc.pg or "gloo", desc.nbytes, desc.tensors, ask, deadline, where
        )

    def stats(self) -> dict[str, int]:
        return {"segments": len(self.maps), "attached": self.maps.attached, "stale": self.maps.stale}

    @property
    def cuda_ipc_fetches(self) -> int:
        """torch fetches that were copied through CUDA IPC (sender on this GPU)."""
        return self._torch_in.ipc_fetches

    def close(self) -> None:
        self.maps.close()
        self.channels.close()
        self._torch_in.close()
