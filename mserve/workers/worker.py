"""A worker process: one role (encode, prefill, decode or unified) around one Engine, driven by the coordinator.

The loop is: take every queued control message, run one batch of work (a vision forward over all
queued images, or one engine step), report results, heartbeat. Tensors leave through the
transfer engine (the coordinator only ever sees their descriptors); Redis gets this worker's
registration, load and cache indexes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import OrderedDict
from typing import Any

import torch
import zmq

from mserve.common.model import ImageError, decode_image
from mserve.common.protocol import COORDINATOR_TO_WORKER, MsgType, ProtocolError, body, validate
from mserve.common.redis_store import RedisStore
from mserve.common.serde import WireError
from mserve.common.sockets import make_socket, recv, send
from mserve.common.transfer import TransferEngine, TransferError
from mserve.workers.block_pool import OutOfBlocks
from mserve.workers.engine import Engine, EngineConfig, StepOutput, sampling_from_dict
from mserve.workers.model_runner import EncodedImage
from mserve.workers.settings import WorkerSettings

log = logging.getLogger("mserve.worker")

# Fetches run inside the worker loop: bounded well below the stage timeout, so a vanished sender
# costs one retryable failure quickly instead of a stalled worker.
FETCH_TIMEOUT_S = 10.0


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


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        torch.set_num_threads(settings.threads)
        self.s = settings
        self.worker_id = settings.resolved_id()
        self.role = settings.role
        self.model_name = settings.model_name or settings.model
        num_blocks = 16 if self.role == "encode" else settings.num_blocks  # encode keeps no KV
        self.engine = Engine(EngineConfig(
            settings.model, device=settings.device, dtype=settings.dtype, block_size=settings.block_size,
            num_blocks=num_blocks, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_prefix_caching=settings.enable_prefix_caching, max_image_pixels=settings.max_image_pixels,
            max_image_bytes=settings.max_image_bytes))
        self.ctx = zmq.Context.instance()
        self.transfer = TransferEngine(self.worker_id, backend=settings.transfer, host=settings.host, ctx=self.ctx,
                                       device=settings.device, shm_pool_bytes=settings.transfer_pool_mb * 2**20)
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=settings.coordinator, identity=self.worker_id.encode())
        self.store = RedisStore(settings.redis) if settings.redis else None
        self.cache = EmbeddingCache(settings.embedding_cache_mb * 2**20)
        self.encode_queue: list[dict[str, Any]] = []
        self.attempts: dict[str, int] = {}  # engine request id -> coordinator attempt
        self.fetch_s: dict[str, float] = {}  # transfer time to report with a request's first output
        self.cached_tokens: dict[str, int] = {}
        self.fresh: set[str] = set()  # requests that have not reported a token yet
        self.received: dict[str, float] = {}  # when each request's stage arrived: its worker_s
        self.running = True
        self._next_beat = 0.0
        self._tokens_ewma = 0.0
        self._last_rate_t = time.monotonic()
        self._tokens_since = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "role": self.role, "data_address": self.transfer.address,
                "host_id": self.transfer.host_id, "pid": os.getpid(), "model": self.model_name,
                "block_size": self.s.block_size, "num_blocks": self.engine.pool.num_blocks}

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        if self.store:
            self.store.register_worker(self.worker_id, self.info(), ttl_s=max(3.0, 8 * self.s.heartbeat_s))
        self._send(MsgType.READY, body(**self.info(), load=self.load()))
        log.info("worker %s ready: role %s, data plane %s (%s)", self.worker_id, self.role, self.transfer.address,
                 self.s.transfer)
        try:
            while self.running:
                busy = bool(self.encode_queue) or self.engine.has_unfinished()
                if self.sock.poll(0 if busy else 20):
                    self._drain()
                if self.encode_queue:
                    self._encode_batch()
                elif self.engine.has_unfinished():
                    self._step()
                self._heartbeat()
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        try:
            send(self.sock, MsgType.BYE, body(worker_id=self.worker_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self.store:
            self.store.deregister_worker(self.worker_id)
            self.store.close()
        self.transfer.close()
        self.sock.close(linger=200)
        log.info("worker %s stopped", self.worker_id)

    def load(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        return {"queue_len": len(sched.waiting) + len(self.encode_queue), "running": len(sched.running),
                "free_blocks": self.engine.pool.num_free_blocks, "total_blocks": self.engine.pool.num_blocks,
                "tokens_per_s": round(self._tokens_ewma, 2)}

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.s.heartbeat_s
        rate = self._tokens_since / max(now - self._last_rate_t, 1e-6)
        self._tokens_ewma = 0.7 * self._tokens_ewma + 0.3 * rate
        self._tokens_since, self._last_rate_t = 0, now
        load = self.load()
        # The registration rides along: a coordinator that restarted (or declared this worker dead
        # during a long step) re-admits it from its next heartbeat.
        self._send(MsgType.HEARTBEAT, body(**self.info(), load=load))
        if self.store:
            ttl = max(3.0, 8 * self.s.heartbeat_s)
            self.store.heartbeat(self.worker_id, ttl_s=ttl)
            self.store.publish_load(self.worker_id, load, ttl_s=ttl)
            if self.engine.new_prefix_hashes and self.store.add_prefix_blocks(
                    self.model_name, self.worker_id, self.engine.new_prefix_hashes[-4096:]):
                self.engine.new_prefix_hashes = []
        self.engine.new_prefix_hashes = self.engine.new_prefix_hashes[-4096:]  # bounded through outages

    def _send(self, kind: MsgType, payload: dict[str, Any]) -> None:
        """Non-blocking: with no coordinator connected the message is dropped (and logged) rather
        than wedging the loop; the coordinator re-runs whatever it does not hear back about."""
        try:
            send(self.sock, kind, payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("coordinator unreachable: %s for %s dropped", kind.name, payload.get("request_id", "-"))

    # -- messages ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                _, msg_type, payload = recv(self.sock, flags=zmq.NOBLOCK)
                kind = validate(msg_type, payload, COORDINATOR_TO_WORKER)
            except zmq.Again:
                return
            except (WireError, ProtocolError) as exc:
                log.error("dropped a bad message from the coordinator: %s", exc)
                continue
            self._dispatch(kind, payload)

    def _dispatch(self, kind: MsgType, p: dict[str, Any]) -> None:
        if kind is MsgType.SHUTDOWN:
            self.stop()
        elif kind is MsgType.CANCEL:
            self._cancel(str(p["request_id"]))
        elif kind is MsgType.ENCODE:
            self.received[str(p["request_id"])] = time.perf_counter()
            self.encode_queue.append(p)
        elif kind is MsgType.PREFILL:
            self._start(p, self._add_prefill)
        elif kind is MsgType.DECODE:
            self._start(p, self._add_decode)
        elif kind is MsgType.RUN:
            self._start(p, self._add_unified)

    def _cancel(self, rid: str) -> None:
        self.encode_queue = [q for q in self.encode_queue if q["request_id"] != rid]
        self._forget(rid)
        if self.engine.abort(rid):
            log.info("%s cancelled", rid)
        self.attempts.pop(rid, None)

    def _forget(self, rid: str) -> None:
        for table in (self.received, self.fetch_s, self.cached_tokens):
            table.pop(rid, None)
        self.fresh.discard(rid)

    def _failed(self, rid: str, attempt: int, message: str, retryable: bool) -> None:
        self._forget(rid)
        log.warning("%s failed (attempt %d, %s): %s", rid, attempt, "retryable" if retryable else "final", message)
        self._send(MsgType.FAILED, body(request_id=rid, attempt=attempt, message=message, retryable=retryable))

    def _start(self, p: dict[str, Any], add) -> None:
        rid, attempt = str(p["request_id"]), int(p["attempt"])
        self.received[rid] = time.perf_counter()
        self.engine.abort(rid)  # an older attempt of the same request may still be here
        try:
            add(rid, p)
        except TransferError as exc:
            return self._failed(rid, attempt, f"transfer failed: {exc}", retryable=True)
        except (ValueError, ImageError) as exc:
            return self._failed(rid, attempt, str(exc), retryable=False)
        except OutOfBlocks as exc:  # the pool filled since routing: another worker may have room
            return self._failed(rid, attempt, str(exc), retryable=True)
        except Exception as exc:  # a bug must cost this request an attempt, not the worker its life
            log.exception("%s: cannot start", rid)
            self.engine.abort(rid)
            return self._failed(rid, attempt, f"{exc.__class__.__name__}: {exc}", retryable=True)
        self.attempts[rid] = attempt
        self.fresh.add(rid)

    # -- encode ----------------------------------------------------------------------------------------
    def _encode_batch(self) -> None:
        """All queued images of all queued requests through one vision forward."""
        batch, self.encode_queue = self.encode_queue, []
        pending: dict[str, Any] = {}
        failed: set[str] = set()
        for req in batch:
            for im in req["images"]:
                if self.cache.get(im["hash"]) is None and im["hash"] not in pending:
                    try:
                        pending[im["hash"]] = decode_image(im["data"], self.s.max_image_pixels)
                    except ImageError as exc:
                        failed.add(req["request_id"])
                        self._failed(req["request_id"], req["attempt"], str(exc), retryable=False)
                        break
        if pending:
            try:
                encoded = self.engine.runner.encode_images(list(pending.values()))
            except Exception as exc:  # the vision tower failed on this batch: its requests try elsewhere
                log.exception("vision forward failed for %d images", len(pending))
                for req in batch:
                    if req["request_id"] not in failed:
                        self._failed(req["request_id"], req["attempt"], f"encode failed: {exc}", retryable=True)
                return
            for h, enc in zip(pending, encoded):
                for gone in self.cache.put(h, enc):
                    if self.store:
                        self.store.remove_embedding(self.model_name, gone, self.worker_id)
                if self.store:
                    self.store.add_embedding(self.model_name, h, self.worker_id)
            self.engine.counters["encoded_images"] += len(pending)
            if self.store:
                self.store.incr_counter("encoded_images", self.worker_id, len(pending))
        for req in batch:
            if req["request_id"] not in failed:
                self._send_encoded(req, new_hashes=set(pending))

    def _send_encoded(self, req: dict[str, Any], new_hashes: set[str]) -> None:
        rid, attempt = req["request_id"], req["attempt"]
        tensors, images, hits = {}, [], 0
        for i, im in enumerate(req["images"]):
            enc = self.cache.get(im["hash"])
            if enc is None:  # evicted by this very batch: tiny cache; fail over to a re-run
                return self._failed(rid, attempt, "embedding evicted before it was sent", retryable=True)
            tensors[f"img{i}"] = enc.embeds
            images.append({"hash": im["hash"], "tokens": int(enc.embeds.shape[0]),
                           "grid": list(enc.grid_thw) if enc.grid_thw else None})
            hits += im["hash"] not in new_hashes
        if hits and self.store:
            self.store.incr_counter("embedding_cache_hits", self.worker_id, hits)
        desc = self.transfer.publish(f"{rid}:{attempt}:emb", tensors)
        self._send(MsgType.ENCODED, body(request_id=rid, attempt=attempt, descriptor=desc, images=images,
                                              cache_hits=hits, worker_s=self._worker_s(rid)))

    def _worker_s(self, rid: str) -> float:
        """Time this request's stage spent in this worker (queueing included), for overhead accounting."""
        t0 = self.received.pop(rid, None)
        return round(time.perf_counter() - t0, 6) if t0 is not None else 0.0

    # -- prefill / decode / unified -----------------------------------------------------------------------
    def _fetch(self, rid: str, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        tensors = self.transfer.fetch(descriptor, timeout_s=FETCH_TIMEOUT_S)
        self.fetch_s[rid] = self.fetch_s.get(rid, 0.0) + time.perf_counter() - t0
        return tensors

    def _add_prefill(self, rid: str, p: dict[str, Any]) -> None:
        encoded = []
        if p.get("embeddings"):
            tensors = self._fetch(rid, p["embeddings"])
            grids = p.get("grids") or [None] * len(tensors)
            encoded = [EncodedImage(tensors[f"img{i}"], tuple(grids[i]) if grids[i] else None)
                       for i in range(len(tensors))]
        seq = self.engine.add_request(rid, p["prompt_ids"], encoded=encoded, image_hashes=p.get("image_hashes"),
                                      sampling=sampling_from_dict(p["sampling"]), priority=int(p.get("priority", 0)),
                                      prefill_only=True, output_ids=p.get("output_ids") or [])
        self.cached_tokens[rid] = seq.num_cached_tokens

    def _add_decode(self, rid: str, p: dict[str, Any]) -> None:
        # Zero-copy: over shm the tensors are views of the prefill worker's segment and
        # import_kv's copy into this pool is the only copy on this side. Leaving the block
        # releases the view: the ack that lets the sender reuse the segment.
        t0 = time.perf_counter()
        view = self.transfer.fetch_view(p["descriptor"], timeout_s=FETCH_TIMEOUT_S)
        self.fetch_s[rid] = self.fetch_s.get(rid, 0.0) + time.perf_counter() - t0
        with view as tensors:
            # The request keeps its prompt inputs for its lifetime (recompute after preemption),
            # so those must not stay views; they are small next to the KV.
            keep = (lambda t: t.clone()) if view.zero_copy else (lambda t: t)
            state = dict(p["state"])
            n_images = len(state["images"])
            mrope = tensors.get("mrope")
            payload = {**state, "kv": tensors["kv"], "mrope_positions": keep(mrope) if mrope is not None else None,
                       "image_embeds": [keep(tensors[f"emb{i}"]) for i in range(n_images) if f"emb{i}" in tensors]}
            self.engine.import_kv(payload, request_id=rid)

    def _add_unified(self, rid: str, p: dict[str, Any]) -> None:
        images = [im["data"] for im in p.get("images") or []]
        seq = self.engine.add_request(rid, p["prompt_ids"], images=images,
                                      sampling=sampling_from_dict(p["sampling"]), priority=int(p.get("priority", 0)),
                                      output_ids=p.get("output_ids") or [])
        self.cached_tokens[rid] = seq.num_cached_tokens

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing its requests")
            for rid in list(self.engine.requests):
                attempt = self.attempts.pop(rid, None)
                self.engine.abort(rid)
                if attempt is not None:
                    self._failed(rid, attempt, f"engine step failed: {exc.__class__.__name__}: {exc}", retryable=True)
            return
        self._report(outputs)

    def _report(self, outputs: list[StepOutput]) -> None:
        items = []
        for out in outputs:
            rid = out.request_id
            attempt = self.attempts.get(rid)
            if attempt is None:
                continue
            self._tokens_since += len(out.new_token_ids)
            if self.role == "prefill":
                self._send_prefilled(rid, attempt, out)
                continue
            item = {"request_id": rid, "attempt": attempt, "token_ids": out.new_token_ids, "finished": out.finished,
                    "finish_reason": out.finish_reason, "first": rid in self.fresh}
            self.fresh.discard(rid)
            if rid in self.fetch_s:
                item["fetch_s"] = self.fetch_s.pop(rid)
            items.append(item)
            if out.finished:
                self.attempts.pop(rid, None)
                item["worker_s"] = self._worker_s(rid)
                item["cached_tokens"] = self.cached_tokens.pop(rid, 0)
        if items:
            self._send(MsgType.STEP_TOKENS, body(items=items))

    def _send_prefilled(self, rid: str, attempt: int, out: StepOutput) -> None:
        self.attempts.pop(rid, None)
        msg = {"request_id": rid, "attempt": attempt, "token_id": out.new_token_ids[0],
               "finish_reason": out.finish_reason, "fetch_s": self.fetch_s.pop(rid, 0.0),
               "cached_tokens": self.cached_tokens.pop(rid, 0), "descriptor": None, "state": None,
               "worker_s": self._worker_s(rid)}
        if out.finish_reason == "prefilled":
            # The KV blocks are gathered straight into the transfer's buffer (a pooled shm
            # segment for shm/auto): publishing then copies nothing.
            allocs = []

            def alloc(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
                allocs.append(self.transfer.alloc(spec))
                return allocs[-1].tensors

            try:
                payload = self.engine.export_kv(rid, alloc=alloc)
                msg["descriptor"] = self.transfer.publish_allocated(f"{rid}:{attempt}:kv", allocs[0])
            finally:
                for a in allocs:
                    a.free()  # a no-op once published
            for key in ("kv", "mrope_positions", "image_embeds"):
                payload.pop(key)
            msg["state"] = payload
        self._send(MsgType.PREFILLED, body(**msg))
