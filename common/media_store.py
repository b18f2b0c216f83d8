"""The media store: media bytes go once from the client (or gateway) to the encoders, never through the coordinator.

A client that holds a `MediaStore` puts each image, audio clip and video file of a request in it and
sends, in place of the bytes, a `MediaRef` (common/protocol/client.py): the content hash, the header
facts admission counts from (common/media_facts.py), the byte length and where to pull it. The store
is a transfer engine (common/transfer/) whose items are *shared* transfers: any number of encoders
(retries, single flight, spread encodes) fetch them, over shm from the same host and tcp from any
other, until the store releases them (LRU by bytes) or they expire. The bytes move only when an
encoder pulls them: an encoder that already holds the item's embeddings (its L1 / L2 tiers) never
pulls, so an item the cluster already holds is never uploaded.

The encode (or unified) worker pulls with `pull_media` and checks the bytes against the ref's facts
before decoding: a mismatch, or a store it cannot reach, fails that request with a `MediaError`
naming the item and the fact (an ImageError: the request is bad, retrying elsewhere would not help).
A store's shm segments are named after its process (common/transfer/shm_pool.py): a store killed
outright leaves them behind, and the next transfer engine started on the host, or a worker whose pull
finds their owner gone, unlinks them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from mserve.common.images import ImageError, image_hash
from mserve.common.media_facts import MediaError, check_facts, read_facts
from mserve.common.protocol.client import MEDIA_KINDS, MediaRef
from mserve.common.sockets import is_loopback
from mserve.common.transfer.descriptor import TransferError, as_descriptor
from mserve.common.transfer.engine import TransferEngine
from mserve.common.transfer.shm_pool import owner_gone, reap_orphans

__all__ = ["MediaError", "MediaStore", "pull_media"]

# How long an item stays pullable after it was last put (a request outliving it fails clearly).
DEFAULT_TTL_S = 600.0
DEFAULT_CAPACITY_BYTES = 1 << 30
_TENSOR = "bytes"
# A store that let a pull run out its whole timeout (its holder killed, or unreachable) is remembered, by its
# engine's name (new in every process), for this long: a worker's further pulls from it fail at once instead
# of each holding the worker for another timeout (a killed gateway's in-flight items, one after another).
UNANSWERED_MEMORY_S = 60.0
_unanswered: dict[str, float] = {}  # store's engine name -> when a pull from it ran out its timeout


class MediaStore:
    """Media items published for the encoders to pull; one per client (or gateway) process.

    `host`: the address encoders reach this process at (127.0.0.1 on one host). `backend`: the
    transfer engine's ("auto": shm to the same host, tcp to others)."""

    def __init__(self, host: str = "127.0.0.1", *, backend: str = "auto", ttl_s: float = DEFAULT_TTL_S,
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.engine = TransferEngine(f"media-{uuid.uuid4().hex[:12]}", backend=backend, host=host, ttl_s=ttl_s)
        self.ttl_s, self.capacity_bytes = ttl_s, capacity_bytes
        self._items: OrderedDict[str, tuple[MediaRef, str]] = OrderedDict()  # kind:hash -> (ref, transfer id), LRU
        self._bytes = 0
        self._lock = threading.Lock()  # an AsyncClient's gateway and a Client's threads both put
        self.published = 0  # items staged (a repeat of a held one is not)

    def put_image(self, data: bytes) -> MediaRef:
        return self.put(data, "image")

    def put(self, data: bytes, kind: str) -> MediaRef:
        """The ref of one item (an image, an audio clip, a video file): published once per content
        hash, while it stays held."""
        h = image_hash(data)
        key = f"{kind}:{h}"
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                self._items.move_to_end(key)
                return held[0]
        try:
            facts = read_facts(kind, data)
        except ImageError:
            facts = {"size": [0, 0]}  # admission refuses it, naming the item, as it refuses unreadable inline bytes
        tid = f"{h}-{uuid.uuid4().hex[:8]}"
        staged = self.engine.alloc({_TENSOR: ((len(data),), torch.uint8)})  # written once, where it is served
        staged.tensors[_TENSOR].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        desc = self.engine.publish_allocated(tid, staged, shared=True)
        ref = MediaRef(hash=h, nbytes=len(data), source=desc.to_wire(), kind=kind, **facts)
        with self._lock:
            self._items[key] = (ref, tid)
            self._bytes += len(data)
            self.published += 1
            evicted = self._evict()
        for old in evicted:
            self.engine.release(old)
        return ref

    def _evict(self) -> list[str]:
        out = []
        while self._bytes > self.capacity_bytes and len(self._items) > 1:
            _, (ref, tid) = self._items.popitem(last=False)
            self._bytes -= ref.nbytes
            out.append(tid)
        return out

    def store_messages(self, body: dict[str, Any]) -> dict[str, Any]:
        """A GENERATE body (client_core.generate_body's) with each inline image, audio clip and video file
        replaced by its ref (a video given as frames stays inline)."""
        messages = []
        for msg in body["messages"]:
            content = msg.get("content")
            if isinstance(content, list):
                content = [self._stored_part(p) for p in content]
                msg = {**msg, "content": content}
            messages.append(msg)
        return {**body, "messages": messages}

    def _stored_part(self, part: Any) -> Any:
        kind = part.get("type") if isinstance(part, dict) else None
        data = part.get(kind) if kind in MEDIA_KINDS else None
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return part
        return {"type": kind, "media": self.put(bytes(data), kind).fields()}

    def stats(self) -> dict[str, Any]:
        """Items held, and the engine's counters (`served`, `bytes_sent`: what encoders pulled)."""
        s = self.engine.stats()
        with self._lock:
            return {"items": len(self._items), "bytes": self._bytes, "published": self.published,
                    "served": s["served"], "bytes_sent": s["bytes_sent"]}

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> MediaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pull_media(transfer: TransferEngine, ref: MediaRef, timeout_s: float) -> bytes:
    """The item's bytes from its store, checked against the ref's facts; MediaError naming the item otherwise
    (each cause its own words: not a store item, a store this worker may not or cannot reach by its address,
    or a store that did not serve it)."""
    where = f"{ref.kind} {ref.hash} in the media store at {ref.source.get('address', '?')}"
    try:
        source = as_descriptor(ref.source)
    except (TransferError, KeyError) as exc:
        raise MediaError(f"{where} is not a media store item: {exc}") from None
    if not source.shared or [(e.name, e.dtype, e.shape) for e in source.tensors] != [(_TENSOR, torch.uint8, (ref.nbytes,))]:
        raise MediaError(f"{where} is not a media store item of {ref.nbytes} bytes (a shared transfer of one "
                         f"uint8 tensor {_TENSOR!r})")  # checked before a byte is pulled
    if source.key is None and transfer.key is not None:
        raise MediaError(f"{where} cannot be pulled: the store has no CURVE keys and this worker's data plane "
                         "admits CURVE peers only: with --curve-dir, its owner must send media inline "
                         "(--media-store-host none)")
    if source.host_id != transfer.host_id and is_loopback(source.address):
        raise MediaError(f"{where} cannot be pulled: the store is bound on a loopback address of another host: "
                         "its owner's --media-store-host must be an address the workers reach (or none: media inline)")
    started, unanswered_at = time.monotonic(), _unanswered.get(source.sender)
    if unanswered_at is not None and started - unanswered_at < UNANSWERED_MEMORY_S:
        raise MediaError(f"{where} could not be pulled (its holder is gone?): a pull from its store ran out "
                         f"its timeout {started - unanswered_at:.0f} s ago")
    try:
        with transfer.fetch_view(source, timeout_s) as tensors:  # one copy: out of the store's segment
            data = tensors[_TENSOR].numpy().tobytes()
    except (TransferError, KeyError) as exc:
        if time.monotonic() - started >= 0.9 * timeout_s:
            _remember_unanswered(source.sender)
        raise MediaError(f"{where} could not be pulled (its holder is gone or dropped it): {exc}") from None
    if source.shm is not None and source.host_id == transfer.host_id and owner_gone(source.shm):
        reap_orphans()  # its store was killed outright: nothing unlinks its segments but a sweep
    check_facts(ref, data, where)
    return data


def _remember_unanswered(store: str) -> None:
    now = time.monotonic()
    for name in [n for n, t in _unanswered.items() if now - t >= UNANSWERED_MEMORY_S]:
        _unanswered.pop(name, None)  # pull threads race here: each drop is harmless twice
    _unanswered[store] = now
