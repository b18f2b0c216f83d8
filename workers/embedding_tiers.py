"""The embedding cache tiers an encoding worker reads before running the vision tower, and fills after.

L1 is this process's memory (EmbeddingCache), L2 the host-wide store every worker on the host shares
(common/transfer/host_store.py), and the Redis embedding index tells the coordinator who holds what.
Encode and unified workers both own one EmbeddingTiers, so either role saves the same re-encodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mserve.common.pruning import cache_namespace
from mserve.common.redis_store import RedisStore
from mserve.common.transfer.host_store import HostEmbeddingStore, default_root, host_member
from mserve.workers.model_runner import EncodedImage


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
        """Insert; returns the keys evicted to make room. An item over the whole bound is not kept."""
        size = item.embeds.numel() * item.embeds.element_size()
        if size > self.capacity:
            return []
        if (old_item := self._items.pop(key, None)) is not None:
            self.used -= old_item.embeds.numel() * old_item.embeds.element_size()
        evicted = []
        while self._items and self.used + size > self.capacity:
            old_key, old = self._items.popitem(last=False)
            self.used -= old.embeds.numel() * old.embeds.element_size()
            evicted.append(old_key)
        self._items[key] = item
        self.used += size
        return evicted


class EmbeddingTiers:
    """L1 + L2 lookups and inserts, kept in step with the Redis embedding index.

    `counters` is the engine's counter dict: l1 and l2 hits and evictions are counted there
    (embedding_l1_hits, embedding_l2_hits, embedding_l1_evictions, embedding_l2_evictions), and each tier's bytes
    (embedding_l1_bytes, embedding_l2_bytes: the host's shared tier as this worker last wrote it), so they reach the load report like every other engine counter."""

    def __init__(self, *, l1_bytes: int, l2_bytes: int, l2_dir: str | None, namespace: str, model_name: str,
                 worker_id: str, host_id: str, store: RedisStore | None, counters: dict[str, Any],
                 defer: Callable[..., None] = lambda fn, *args: fn(*args)) -> None:
        self.cache = EmbeddingCache(l1_bytes)
        self.host_cache = HostEmbeddingStore(l2_dir or default_root(), namespace, l2_bytes)
        self.host_member = host_member(host_id)  # the L2 entries' holder in the Redis index
        self.model_name, self.worker_id, self.store, self.counters = model_name, worker_id, store, counters
        self.defer = defer  # how an index write runs: a worker queues it on its Redis lane (common/redis_lane.py)
        for key in ("embedding_l1_hits", "embedding_l2_hits", "embedding_l1_evictions", "embedding_l2_evictions",
                    "embedding_l1_bytes", "embedding_l2_bytes"):
            counters.setdefault(key, 0)

    def peek(self, h: str) -> EncodedImage | None:
        """The image's embeddings from L1, or from L2 (copied into L1); None on a miss. Counts nothing."""
        enc = self.cache.get(h)
        if enc is not None:
            return enc
        stored = self.host_cache.get(h)
        if stored is None:
            return None
        enc = EncodedImage(stored.embeds, stored.grid_thw)
        self._l1_put(h, enc)
        return enc

    def in_memory(self, h: str) -> bool:
        """In L1 (a lookup that reads no disk would find it)."""
        return self.cache.get(h) is not None

    def lookup(self, h: str) -> EncodedImage | None:
        """peek, counting the hit by tier."""
        in_l1 = self.cache.get(h) is not None
        enc = self.peek(h)
        if enc is not None:
            self.counters["embedding_l1_hits" if in_l1 else "embedding_l2_hits"] += 1
        return enc

    def put(self, h: str, enc: EncodedImage) -> None:
        """A freshly encoded image, into L1 and L2, and the Redis index for both."""
        self._l1_put(h, enc)
        evicted = self.host_cache.put(h, enc.embeds, enc.grid_thw)
        self.counters["embedding_l2_evictions"] += len(evicted)
        self.counters["embedding_l2_bytes"] = self.host_cache.used_after_put
        if self.store and self.host_cache.enabled:
            self.defer(self.store.add_embedding, self.model_name, h, self.host_member)
            if evicted:
                self.defer(self.store.drop_worker_embeddings, self.host_member, self.model_name, evicted)

    def _l1_put(self, h: str, enc: EncodedImage) -> None:
        if not self.cache.capacity:
            return
        for gone in self.cache.put(h, enc):
            self.counters["embedding_l1_evictions"] += 1
            if self.store:
                self.defer(self.store.remove_embedding, self.model_name, gone, self.worker_id)
        self.counters["embedding_l1_bytes"] = self.cache.used
        if self.store:
            self.defer(self.store.add_embedding, self.model_name, h, self.worker_id)

    def republish(self) -> int:
        """Redis came back empty, or answers again after an outage (whose writes the lane dropped): index
        every entry held again. Returns how many."""
        hashes, shared = self.cache.keys(), self.host_cache.keys()
        if self.store is not None:
            if hashes:
                self.defer(self.store.add_embeddings, self.model_name, hashes, self.worker_id)
            if shared:
                self.defer(self.store.add_embeddings, self.model_name, shared, self.host_member)
        return len(hashes) + len(shared)

    def drop(self) -> None:
        """This worker leaves: its L1 entries leave the index (the host's L2 entries outlive it)."""
        if self.store is not None:
            self.defer(self.store.drop_worker_embeddings, self.worker_id, self.model_name, self.cache.keys())


def embedding_tiers(worker: Any) -> EmbeddingTiers:
    """The tiers of a worker (workers/worker.py Worker), sized by its settings."""
    s = worker.s
    return EmbeddingTiers(l1_bytes=int(s.embedding_cache_mb * 2**20), l2_bytes=int(s.host_embedding_cache_mb * 2**20),
                          l2_dir=s.host_embedding_cache_dir,
                          namespace=cache_namespace(worker.model_name, s.visual_token_pruning),
                          model_name=worker.model_name, worker_id=worker.worker_id,
                          host_id=worker.transfer.host_id, store=worker.store, counters=worker.engine.counters,
                          defer=worker.lane.submit)
