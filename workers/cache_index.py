"""Keeps the cluster's Redis prefix index equal to what one worker's KV pool holds.

The pool notes every hash it starts or stops holding (BlockPool.take_index_changes); this publisher
sends those adds and removals to Redis at most every `every_s`, keeps what Redis did not take for
the next try, and re-adds everything held every `refresh_s` so the entries' TTL (the safety net for
a worker that dies without cleaning up) never lapses while the blocks are still here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from mserve.common.redis_store import DEFAULT_INDEX_TTL_S, RedisStore

if TYPE_CHECKING:
    from mserve.workers.block_pool import BlockPool

log = logging.getLogger("mserve.worker")

MAX_PENDING = 1 << 16  # changes kept through a Redis outage; older ones are lost (a refresh restores adds)


class PrefixIndexPublisher:
    def __init__(self, store: RedisStore, model: str, worker_id: str, pool: BlockPool, *, every_s: float,
                 ttl_s: float = DEFAULT_INDEX_TTL_S) -> None:
        self.store, self.model, self.worker_id, self.pool = store, model, worker_id, pool
        self.every_s = every_s
        self.ttl_s = ttl_s
        self.refresh_s = ttl_s / 3
        self.pending: OrderedDict[str, bool] = OrderedDict()
        self._next_flush = 0.0
        self._next_refresh = 0.0
        self.published = 0
        self.removed = 0

    def flush(self, now: float, force: bool = False) -> bool:
        """Send what changed (when due, or `force`); True when Redis now matches the pool."""
        if not force and now < self._next_flush:
            return not self.pending
        self._next_flush = now + self.every_s
        for h, held in self.pool.take_index_changes().items():
            self.pending.pop(h, None)
            self.pending[h] = held
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        if now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
            for h in self.pool.cached_hashes():  # re-add all held: refreshes every entry's TTL
                self.pending.setdefault(h, True)
        if not self.pending:
            return True
        adds = [h for h, held in self.pending.items() if held]
        removes = [h for h, held in self.pending.items() if not held]
        if not self.store.update_prefix_blocks(self.model, self.worker_id, adds, removes, ttl_s=self.ttl_s):
            return False  # Redis is down: keep them for the next try
        self.published += len(adds)
        self.removed += len(removes)
        self.pending.clear()
        return True

    def republish(self) -> int:
        """Redis came back empty: index everything held again. Returns how many entries."""
        self._next_refresh = 0.0
        self.flush(0.0, force=True)
        return len(self.pool.cached_hashes())
