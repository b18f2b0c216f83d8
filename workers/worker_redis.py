"""One worker's part in the cluster's Redis: its registration and load, the coordinator shard registry it
follows, and the prefix index of its KV pool. Every call while it serves runs on its Redis lane
(common/redis_lane.py); only the registration before READY and the goodbye are made in line.

The embedding index is the embedding tiers' (workers/embedding_tiers.py): they queue on the same lane.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from mserve.common.protocol.to_coordinator import WorkerLoad
from mserve.common.redis_store import RedisStore
from mserve.common.shards import ShardRegistry, is_redis_url
from mserve.workers.cache_index import PrefixIndexPublisher
from mserve.common.redis_lane import RedisLane

if TYPE_CHECKING:
    from mserve.workers.block_pool import BlockPool
    from mserve.workers.settings import WorkerSettings

REGISTRY_READ_S = 1.0  # how often the loop follows the shard registry

# Cache counters that Redis load stats carry too (hit rates per tier, for `mserve status` and autoscalers).
CACHE_COUNTERS = ("embedding_l1_hits", "embedding_l2_hits", "encoded_images", "prefix_hits", "prefix_queries",
                  "cached_blocks", "indexed_blocks", "prefix_evictions", "encodes_skipped_by_prefix",
                  "prefix_skip_fallbacks")


def redis_load(load: WorkerLoad) -> dict[str, Any]:
    """The load as Redis keeps it (a flat hash): the queued ids, other counters and histograms go to the coordinator only."""
    counters = load.counters or {}
    return {**dataclasses.replace(load, queued=None, counters=None, histograms=None).fields(),
            **{k: counters[k] for k in CACHE_COUNTERS if k in counters}}


class WorkerRedis:
    def __init__(self, s: WorkerSettings, worker_id: str, model_name: str, pool: BlockPool) -> None:
        self.worker_id = worker_id
        self.ttl_s = max(3.0, 8 * s.heartbeat_s)
        self.lane = RedisLane()
        self.store = RedisStore(s.redis, socket_timeout_s=s.redis_timeout_s) if s.redis else None
        # Shards announced in --redis are followed, and those of --coordinator redis://... when it names another.
        registry_store, self._registry_store = self.store, None
        if is_redis_url(s.coordinator) and s.coordinator != s.redis:
            registry_store = self._registry_store = RedisStore(s.coordinator, socket_timeout_s=s.redis_timeout_s)
        self.registry = ShardRegistry(registry_store) if registry_store is not None else None
        self.prefix_index = (PrefixIndexPublisher(self.store, model_name, worker_id, pool, every_s=s.heartbeat_s)
                             if self.store is not None and s.enable_prefix_caching else None)
        self.live: dict[str, dict[str, str]] | None = None  # the latest read of the shard registry
        self._next_registry_read = 0.0
        self._seen_losses = 0  # state losses and recoveries republished for

    # -- in line: before READY ------------------------------------------------------------------------
    def register(self, fields: dict[str, Any], load: WorkerLoad) -> None:
        """Registration and load in Redis before the coordinator hears of this worker; the registry's shards."""
        if self.store is not None:
            self.store.register_worker(self.worker_id, fields, ttl_s=self.ttl_s)
            self.store.publish_load(self.worker_id, redis_load(load), ttl_s=self.ttl_s)
        if self.registry is not None:
            self._read_registry()
            self._next_registry_read = time.monotonic() + REGISTRY_READ_S

    # -- queued on the lane ------------------------------------------------------------------------------
    def beat(self, load: WorkerLoad) -> None:
        """From the pulse: the newest load replaces one still waiting for a slow Redis."""
        if self.store is not None:
            self.lane.submit(self._beat, redis_load(load), key="heartbeat")

    def _beat(self, load: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.heartbeat(self.worker_id, ttl_s=self.ttl_s)  # re-creates the registration Redis lost
        self.store.publish_load(self.worker_id, load, ttl_s=self.ttl_s)

    def registry_due(self, now: float) -> dict[str, dict[str, str]] | None:
        """On the loop: once every REGISTRY_READ_S, queue a read of the shard registry and return the latest
        one made (None: not due, or nothing read yet)."""
        if self.registry is None or now < self._next_registry_read:
            return None
        self._next_registry_read = now + REGISTRY_READ_S
        self.lane.submit(self._read_registry, key="registry")
        return self.live

    def _read_registry(self) -> None:
        assert self.registry is not None
        self.live = self.registry.live()

    def publish_prefixes(self, now: float) -> None:
        """On the loop: gather which blocks the pool gained and evicted; the lane tells the prefix index."""
        if self.prefix_index is not None and self.prefix_index.collect(now):
            self.lane.submit(self.prefix_index.send, key="prefix-index")

    def indexes_lost(self) -> bool:
        """Since the last call Redis came back empty (restart, FLUSHALL), or came back after an outage whose
        index writes the store dropped: the indexes need republishing."""
        if self.store is None or self.store.state_losses + self.store.recoveries == self._seen_losses:
            return False
        self._seen_losses = self.store.state_losses + self.store.recoveries
        return True

    def republish_prefixes(self) -> int:
        """Every block the pool holds, into the prefix index again; returns how many."""
        if self.prefix_index is None:
            return 0
        n = self.prefix_index.republish()
        self.lane.submit(self.prefix_index.send, key="prefix-index")
        return n

    def drop_prefixes(self, held: list[str]) -> None:
        """On a clean exit: this worker's blocks out of the prefix index (the TTL covers a crash)."""
        if self.store is not None and self.prefix_index is not None:
            self.lane.submit(self.store.update_prefix_blocks, self.prefix_index.model, self.worker_id, [], held)

    # -- the goodbye -------------------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Deregister after what is queued; wait at most `timeout_s` for Redis to take it."""
        if self.store is not None:
            self.lane.submit(self.store.deregister_worker, self.worker_id)
        self.lane.close(timeout_s)
        for store in (self.store, self._registry_store):
            if store is not None:
                store.close()
