"""Encode role: decode and preprocess images, run the vision tower + projector, keep and hand out embeddings."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

from mserve.common.model import ImageError
from mserve.common.protocol.to_coordinator import Encoded, EncodedImageInfo
from mserve.common.protocol.to_worker import LATENCY_CLASSES, EncodeTask, ImageRef
from mserve.common.video import VideoPart
from mserve.workers.engine import EngineConfig
from mserve.workers.model_runner import EncodedImage
from mserve.workers.settings import WorkerSettings
from mserve.workers.worker import Worker

log = logging.getLogger("mserve.worker")


class EmbeddingCache:
    """Encoded images by hash, least recently used evicted first, bounded by bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._items: OrderedDict[str, EncodedImage] = OrderedDict()

    def get(self, key: str) -> EncodedImage | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def keys(self) -> list[str]:
        return list(self._items)

    def put(self, key: str, item: EncodedImage) -> list[str]:
        """Insert; returns the keys evicted to make room."""
        size = item.embeds.numel() * item.embeds.element_size()
        evicted = []
        while self._items and self.used + size > self.capacity:
            old_key, old = self._items.popitem(last=False)
            self.used -= old.embeds.numel() * old.embeds.element_size()
            evicted.append(old_key)
        self._items[key] = item
        self.used += size
        return evicted


def visual_input(ref: ImageRef) -> bytes | VideoPart:
    """What the engine decodes for one ImageRef: image bytes, or a video (frames, or a file and its frames)."""
    if ref.frames is not None:
        return VideoPart(frames=tuple(ref.frames))
    if ref.frame_indices is not None:
        return VideoPart(data=ref.data, indices=tuple(ref.frame_indices))
    return ref.data


def next_encode_batch(queue: list[EncodeTask], max_images: int) -> tuple[list[EncodeTask], list[EncodeTask]]:
    """(the requests for one vision forward, the rest). Priority first, then interactive before
    batch, then arrival, up to `max_images` images, a video counting its frames (a request's images
    go together; a request with more images than that goes alone), so an interactive image waits for
    one bounded batch."""
    order = sorted(range(len(queue)), key=lambda i: (-queue[i].priority,
                                                     LATENCY_CLASSES.index(queue[i].latency_class), i))
    take, images = [], 0
    for i in order:
        n = sum(im.num_frames for im in queue[i].images)  # a video weighs its frames
        if take and images + n > max_images:
            break
        take.append(i)
        images += n
    chosen = set(take)
    return [queue[i] for i in take], [t for i, t in enumerate(queue) if i not in chosen]


class EncodeWorker(Worker):
    ROLE = "encode"
    PARTS = "vision"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.cache = EmbeddingCache(settings.embedding_cache_mb * 2**20)
        self.queue: list[EncodeTask] = []

    def engine_config(self, s: WorkerSettings) -> EngineConfig:
        return dataclasses.replace(super().engine_config(s), num_blocks=16)  # an encoder keeps no KV

    def start(self, task: EncodeTask) -> None:
        self.queue.append(task)

    def republish_indexes(self) -> int:
        hashes = self.cache.keys()
        if hashes and self.store is not None:
            self.store.add_embeddings(self.model_name, hashes, self.worker_id)
        return len(hashes)

    def busy(self) -> bool:
        return bool(self.queue)

    def queued_ids(self) -> list[str]:
        return [t.request_id for t in list(self.queue)]

    def cancel(self, rid: str) -> None:
        self.queue = [t for t in self.queue if t.request_id != rid]
        super().cancel(rid)

    def work(self) -> None:
        """The next batch of queued requests' images through one vision forward."""
        batch, self.queue = next_encode_batch(self.queue, self.s.max_encode_images)
        pending: dict[str, Any] = {}
        failed: set[str] = set()
        for task in batch:
            for im in task.images:
                if self.cache.get(im.hash) is None and im.hash not in pending:
                    try:
                        pending[im.hash] = self.engine.decode_visual(visual_input(im))
                    except ImageError as exc:
                        failed.add(task.request_id)
                        self.failed(task.request_id, task.attempt, str(exc), retryable=False)
                        break
        if pending and not self._encode(pending, [t for t in batch if t.request_id not in failed]):
            return
        for task in batch:
            if task.request_id not in failed:
                self._send_encoded(task, new_hashes=set(pending))

    def _encode(self, pending: dict[str, Any], batch: list[EncodeTask]) -> bool:
        try:
            encoded = self.engine.runner.encode_visuals(list(pending.values()))
        except Exception as exc:  # the vision tower failed on this batch: its requests try elsewhere
            log.exception("vision forward failed for %d images", len(pending))
            for task in batch:
                self.failed(task.request_id, task.attempt, f"encode failed: {exc}", retryable=True)
            return False
        for h, enc in zip(pending, encoded):
            for gone in self.cache.put(h, enc):
                if self.store:
                    self.store.remove_embedding(self.model_name, gone, self.worker_id)
            if self.store:
                self.store.add_embedding(self.model_name, h, self.worker_id)
        self.engine.counters["encoded_images"] += len(pending)
        self.engine.counters["visual_tokens"] += sum(int(enc.embeds.shape[0]) for enc in encoded)
        if self.store:
            self.store.incr_counter("encoded_images", self.worker_id, len(pending))
        return True

    def _send_encoded(self, task: EncodeTask, new_hashes: set[str]) -> None:
        rid, attempt = task.request_id, task.attempt
        tensors, images, hits = {}, [], 0
        for i, im in enumerate(task.images):
            enc = self.cache.get(im.hash)
            if enc is None:  # evicted by this very batch: tiny cache; fail over to a re-run
                return self.failed(rid, attempt, "embedding evicted before it was sent", retryable=True)
            tensors[f"img{i}"] = enc.embeds
            images.append(EncodedImageInfo(hash=im.hash, tokens=int(enc.embeds.shape[0]),
                                           grid=list(enc.grid_thw) if enc.grid_thw else None))
            hits += im.hash not in new_hashes
        self.engine.counters["embedding_cache_hits"] += hits
        if hits and self.store:
            self.store.incr_counter("embedding_cache_hits", self.worker_id, hits)
        desc = self.transfer.publish(f"{rid}:{attempt}:emb", tensors)
        self.send(Encoded(request_id=rid, attempt=attempt, descriptor=desc.to_wire(), images=images, cache_hits=hits,
                          worker_s=self.worker_s(rid)))
