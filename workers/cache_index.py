"""Keeps the cluster's Redis prefix index equal to what one worker's KV pool holds.

The pool notes every hash it starts or stops holding (BlockPool.take_index_changes); this publisher
collects those adds and removals at most every `every_s` on the worker's loop, sends them from the
worker's Redis lane (common/redis_lane.py, so the loop never waits on Redis), keeps what Redis did not
take for the next try, and re-adds everything held every `refresh_s` so the entries' TTL (the safety net for
a worker that dies without cleaning up) never lapses while the blocks are still here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from mserve.common.redis_indexes import DEFAULT_INDEX_TTL_S
from mserve.common.redis_store import RedisStore

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
        self._lock = threading.Lock()  # pending: filled on the loop, sent from the Redis lane
        self.pending: OrderedDict[str, bool] = OrderedDict()
        self._next_flush = 0.0
        self._next_refresh = 0.0
        self.published = 0
        self.removed = 0

    def flush(self, now: float, force: bool = False) -> bool:
        """collect, then send, on the caller's thread; True when Redis now matches the pool."""
        self.collect(now, force)
        return self.send()

    def collect(self, now: float, force: bool = False) -> bool:
        """On the loop (the pool's thread): take what changed, when due (or `force`); True when there
        is something for `send`."""
        if not force and now < self._next_flush:
            return False
        self._next_flush = now + self.every_s
        changes = self.pool.take_index_changes()
        refresh = now >= self._next_refresh
        held = self.pool.cached_hashes() if refresh else ()
        if refresh:
            self._next_refresh = now + self.refresh_s
        with self._lock:
            for h, is_held in changes.items():
                self.pending.pop(h, None)
                self.pending[h] = is_held
            for h in held:  # re-add all held: refreshes every entry's TTL
                self.pending.setdefault(h, True)
            while len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
            return bool(self.pending)

    def send(self) -> bool:
        """Send what `collect` gathered (on any thread: the worker's Redis lane, common/redis_lane.py);
        True when Redis now has it. What Redis did not take stays for the next try."""
        with self._lock:
            sent = dict(self.pending)
        if not sent:
            return True
        adds = [h for h, held in sent.items() if held]
        removes = [h for h, held in sent.items() if not held]
        if not self.store.update_prefix_blocks(self.model, self.worker_id, adds, removes, ttl_s=self.ttl_s):
            return False  # Redis is down: keep them for the next try
        with self._lock:
            for h, held in sent.items():  # what changed again meanwhile stays for the next send
                if self.pending.get(h) is held:
                    del self.pending[h]
            self.published += len(adds)
            self.removed += len(removes)
            return not self.pending

    def republish(self) -> int:
        """Redis came back empty: gather everything held again, for the next `send`. Returns how many."""
        self._next_refresh = 0.0
        self.collect(time.monotonic(), force=True)
        return len(self.pool.cached_hashes())
