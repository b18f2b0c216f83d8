"""Encode role: decode and preprocess images, run the vision tower + projector, keep and hand out embeddings."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

from mserve.common.audio import AudioPart
from mserve.common.media_store import pull_media
from mserve.common.transfer.engine import TransferEngine
from mserve.common.images import ImageError
from mserve.common.protocol.to_coordinator import Encoded, EncodedImageInfo, WorkerLoad
from mserve.common.policy import encode_batch
from mserve.common.protocol.to_worker import EncodeTask, ImageRef
from mserve.common.video import VideoPart
from mserve.workers.embedding_tiers import embedding_tiers
from mserve.workers.engine import EngineConfig
from mserve.workers.image_prefetch import ImagePrefetch
from mserve.workers.model_runner import EncodedImage
from mserve.workers.settings import WorkerSettings
from mserve.workers.worker import Worker

log = logging.getLogger("mserve.worker")


def visual_input(ref: ImageRef) -> bytes | VideoPart | AudioPart:
    """What the engine decodes for one ImageRef: image bytes, a video (frames, or a file and its frames) or
    an audio clip."""
    if ref.audio_samples is not None:
        return AudioPart(ref.data, ref.audio_samples)
    if ref.frames is not None:
        return VideoPart(frames=tuple(ref.frames), fps=ref.fps)
    if ref.frame_indices is not None:
        return VideoPart(data=ref.data, indices=tuple(ref.frame_indices), fps=ref.fps)
    return ref.data


def pulled_input(transfer: TransferEngine, ref: ImageRef, timeout_s: float) -> bytes | VideoPart | AudioPart:
    """`visual_input` of an item in a media store: its bytes pulled from it (checked against its facts),
    in the ImageRef's place (an audio clip's samples, a video file's frames, as admission fixed them)."""
    assert ref.media is not None
    return visual_input(dataclasses.replace(ref, data=pull_media(transfer, ref.media, timeout_s), media=None))


def next_encode_batch(queue: list[EncodeTask], max_images: int) -> tuple[list[EncodeTask], list[EncodeTask]]:
    """(the requests for one vision forward, the rest), by the policy's encode-batch rule."""
    return encode_batch(queue, priority=lambda t: t.priority, latency_class=lambda t: t.latency_class,
                        images=lambda t: sum(im.num_frames for im in t.images), max_images=max_images)


class EncodeWorker(Worker):
    ROLE = "encode"
    PARTS = "vision"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.tiers = embedding_tiers(self)
        self.queue: list[EncodeTask] = []
        self.encode_s_per_image = 0.0  # measured (EWMA): the coordinator weighs re-encoding against it
        # Each request's latest embeddings publication, so a CANCEL frees it before its expiry (bounded:
        # older entries only wait for the expiry). Not in the request's record: it outlives the stage
        # here, whose record ends when ENCODED goes out, while the prefill worker has yet to fetch.
        self.published: OrderedDict[str, str] = OrderedDict()
        self.prefetch = ImagePrefetch(lambda im: self.engine.decode_visual(self.pulled_input(im)))

    def pulled_input(self, ref: ImageRef) -> bytes | VideoPart | AudioPart:
        """`visual_input`, an item in a media store pulled from it first (checked against its facts)."""
        if ref.media is not None:
            return pulled_input(self.transfer, ref, self.s.fetch_timeout_s)
        return visual_input(ref)

    def close(self) -> None:
        self.prefetch.close()
        super().close()

    def load(self) -> WorkerLoad:
        return dataclasses.replace(super().load(), encode_s_per_image=round(self.encode_s_per_image, 5))

    def engine_config(self, s: WorkerSettings) -> EngineConfig:
        return dataclasses.replace(super().engine_config(s), num_blocks=16)  # an encoder keeps no KV

    def start(self, task: EncodeTask) -> None:
        found = {im.hash: enc for im in task.images if (enc := self.lookup(im.hash)) is not None}
        if len(found) == len({im.hash for im in task.images}):
            # Every image is cached here or on this host: no vision forward, so no reason to wait
            # behind one. (A miss goes through the queue, batched by class.)
            self._send_encoded(task, found, fresh=set())
            return
        self.queue.append(task)

    def lookup(self, h: str) -> EncodedImage | None:
        """The image's embeddings from L1, or from L2 (copied into L1); None on a miss."""
        return self.tiers.lookup(h)

    def republish_indexes(self) -> int:
        return self.tiers.republish() + super().republish_indexes()

    def drop_indexes(self) -> None:
        super().drop_indexes()
        self.tiers.drop()

    def busy(self) -> bool:
        return bool(self.queue)

    def queued_ids(self) -> list[str]:
        return [t.request_id for t in list(self.queue)]

    def cancel(self, rid: str) -> None:
        self.queue = [t for t in self.queue if t.request_id != rid]
        tid = self.published.pop(rid, None)
        if tid is not None:
            self.transfer.release(tid)  # a no-op once fetched
        super().cancel(rid)

    def work(self) -> None:
        """The next batch of queued requests' images through one vision forward (the batch after it
        decoding meanwhile, workers/image_prefetch.py)."""
        batch, self.queue = next_encode_batch(self.queue, self.s.max_encode_images)
        upcoming, _ = next_encode_batch(self.queue, self.s.max_encode_images)
        self.prefetch.keep([im for task in batch + upcoming for im in task.images])
        self.prefetch.start([im for task in upcoming for im in task.images if not self.tiers.in_memory(im.hash)])
        started = time.time_ns()
        found: dict[str, EncodedImage] = {}
        pending: dict[str, Any] = {}
        # Which vision forward each image goes through: one per keep ratio (a pruned image's hash carries
        # its ratio), and in exact mode one per request as well (_forward_key).
        forwards: dict[str, tuple[float | None, str | None]] = {}
        failed: set[str] = set()
        for task in batch:
            for im in task.images:
                if im.hash in pending or im.hash in found:
                    continue
                if (enc := self.lookup(im.hash)) is not None:
                    found[im.hash] = enc
                    continue
                try:
                    pending[im.hash] = self.prefetch.take(im)
                    forwards[im.hash] = self._forward_key(task)
                except ImageError as exc:
                    failed.add(task.request_id)
                    self.failed(task.request_id, task.attempt, str(exc), retryable=False)
                    break
        decoded = time.time_ns()
        if pending:
            encoded = self._encode(pending, [t for t in batch if t.request_id not in failed], forwards)
            if encoded is None:
                return
            found.update(encoded)
        for task in batch:
            if task.request_id not in failed:
                self._trace_batch(task, started, decoded, len(pending))
                self._send_encoded(task, found, fresh=set(pending), preprocess_s=(decoded - started) / 1e9)

    def _trace_batch(self, task: EncodeTask, started: int, decoded: int, images: int) -> None:
        """Note the batch's parts on a traced request: its wait here, image decoding, the vision forward."""
        rec = self.requests.get(task.request_id, task.attempt)
        if rec is None or rec.trace is None:
            return
        rec.span("encode.worker_queue", rec.arrived_ns, started)
        rec.span("encode.preprocess", started, decoded, **{"mserve.batch_images": images})
        if images:
            rec.span("encode.compute", decoded, None, **{"mserve.batch_images": images})

    def _forward_key(self, task: EncodeTask) -> tuple[float | None, str | None]:
        """Images with one key share a vision forward. In exact mode (reduced precision: the switch of
        exact-length attention, workers/paged_attention.py) an image's bf16 embeddings depend on the rows
        beside it in the forward (the matmul kernels block by row count), so each request's images run
        together and alone, as HF generate's one get_image_features call per prompt does."""
        return task.keep_ratio, task.request_id if self.engine.runner.exact_attention else None

    def _encode(self, pending: dict[str, Any], batch: list[EncodeTask],
                forwards: dict[str, tuple[float | None, str | None]]) -> dict[str, EncodedImage] | None:
        """One vision forward over the decoded images (one per keep ratio, when requests pruned at their
        own ratios are among them; one per request in exact mode); None when it failed (its requests
        then retry)."""
        t0 = time.perf_counter()
        try:
            by_forward: dict[tuple[float | None, str | None], list[str]] = {}
            for h in pending:
                by_forward.setdefault(forwards[h], []).append(h)
            out: dict[str, EncodedImage] = {}
            for (ratio, _), hashes in by_forward.items():
                out.update(zip(hashes, self.engine.runner.encode_visuals([pending[h] for h in hashes], ratio)))
            encoded = [out[h] for h in pending]
        except Exception as exc:  # the vision tower failed on this batch: its requests try elsewhere
            log.exception("vision forward failed for %d images", len(pending))
            for task in batch:
                self.failed(task.request_id, task.attempt, f"encode failed: {exc}", retryable=True)
            return None
        self.engine.step_seconds.observe(time.perf_counter() - t0)  # an encoder's step: one batch's vision forward
        per_image = (time.perf_counter() - t0) / len(pending)
        self.encode_s_per_image = per_image if not self.encode_s_per_image else \
            0.7 * self.encode_s_per_image + 0.3 * per_image
        for h, enc in zip(pending, encoded):
            self.tiers.put(h, enc)
        self.engine.counters["encoded_images"] += len(pending)
        self.engine.counters["visual_tokens"] += sum(int(enc.embeds.shape[0]) for enc in encoded)
        if self.store:
            self.lane.submit(self.store.incr_counter, "encoded_images", self.worker_id, len(pending))
        return dict(zip(pending, encoded))

    def _send_encoded(self, task: EncodeTask, found: dict[str, EncodedImage], fresh: set[str],
                      preprocess_s: float = 0.0) -> None:
        """Publish the request's embeddings (`found` has every image) and tell the coordinator."""
        rid, attempt = task.request_id, task.attempt
        tensors, images, hits = {}, [], 0
        for i, im in enumerate(task.images):
            enc = found[im.hash]
            tensors[f"img{i}"] = enc.embeds
            images.append(EncodedImageInfo(hash=im.hash, tokens=int(enc.embeds.shape[0]),
                                           grid=list(enc.grid_thw) if enc.grid_thw else None))
            hits += im.hash not in fresh
        c = self.engine.counters
        c["embedding_cache_hits"] += hits
        if (rec := self.requests.get(rid, attempt)) is not None:
            rec.attributes["mserve.embedding_cache_hits"] = hits
        c["embedding_l1_hits"] = c["embedding_cache_hits"] - c["embedding_l2_hits"]
        if hits and self.store:
            self.lane.submit(self.store.incr_counter, "embedding_cache_hits", self.worker_id, hits)
        tid = f"{rid}:{attempt}:emb"
        desc = self.transfer.publish(tid, tensors)
        self.published[rid] = tid
        while len(self.published) > 4096:
            self.published.popitem(last=False)
        rec = self.requests.get(rid, attempt)  # an older attempt's task, still queued, has none
        self.send(Encoded(request_id=rid, attempt=attempt, descriptor=desc.to_wire(), images=images, cache_hits=hits,
                          worker_s=rec.worker_s() if rec is not None else 0.0, preprocess_s=preprocess_s))
        self.end(rid, attempt)
