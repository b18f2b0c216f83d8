"""The coordinator's part in the cluster's Redis: its shard's announcement, the workers' loads it polls, the
cache hints routing reads, and single-flight encode leases.

The loop must not wait on Redis: every stream it relays would wait with it. So the announcement, the
loads poll, lease renewals and releases, and the probes while Redis is down run on the Redis lane
(common/redis_lane.py); the loop applies the newest loads the lane read. What routing must know at once,
the prefix and embedding holders and a lease claim, is read in line, but only while the store is
`responsive` (healthy, and no call out longer than 0.1 s): once the lane's calls find Redis stalled,
routing goes on without hints (holders from the coordinator's own records; a lease granted, as when
Redis is down) until the lane's probe finds it answering again. A request routed in the moment before
the lane notices (at most one loads poll, 0.25 s, plus 0.1 s) may still wait one socket timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from mserve.common.hashing import item_spans, prompt_block_hashes
from mserve.common.redis_lane import RedisLane
from mserve.common.redis_store import RedisStore
from mserve.common.shards import SHARD_REFRESH_S, ShardRegistry
from mserve.coordinator.admission import Admitted
from mserve.coordinator.recent_prefixes import RecentPrefixes, merge_hits

PROBE_S = 1.0  # while Redis is down, the lane tries it this often


class RedisLookups:
    """The machine's cache hints from Redis: who holds an image's embeddings, a prompt's prefix blocks."""

    def __init__(self, store: RedisStore, builder: Any, model_name: str) -> None:
        self.store, self.builder, self.model_name = store, builder, model_name
        self.recent = RecentPrefixes()  # prompts routed here but maybe not yet in the Redis index
        self._hashed: tuple[Admitted, int, list[str]] | None = None  # the last request's block hashes

    def embedding_holders(self, image_hash: str) -> set[str]:
        return self.store.lookup_embedding(self.model_name, image_hash) if self.store.responsive() else set()

    def prefix_hits(self, admitted: Admitted, block_size: int, sent_since: float | None = None) -> dict[str, int]:
        """Who holds the prompt's leading blocks: the Redis index, and where this coordinator sent them
        (with `sent_since`, only what it sent at or after then: recent_prefixes.SKIP_HORIZON_S)."""
        hashes = self._block_hashes(admitted, block_size)
        if not hashes:
            return {}
        published = self.store.match_prefix(self.model_name, hashes) if self.store.responsive() else {}
        return merge_hits(published, self.recent.match(hashes, since=sent_since))

    def placed(self, admitted: Admitted, block_size: int, worker_id: str, now: float = 0.0) -> None:
        self.recent.placed(self._block_hashes(admitted, block_size), worker_id, now)

    def forget(self, worker_id: str) -> None:
        self.recent.forget(worker_id)

    def _block_hashes(self, admitted: Admitted, block_size: int) -> list[str]:
        """The prompt's leading block hashes, computed once per request: routing asks, then `placed` notes them."""
        if self._hashed is not None and self._hashed[0] is admitted and self._hashed[1] == block_size:
            return self._hashed[2]
        ids = admitted.prompt_ids
        hashes: list[str] = []
        if len(ids) >= 2 * block_size:
            # Same keys as the workers' block hashes: each image's hash and offset, not just its placeholder ids.
            spans = item_spans(self.builder.family.image_spans(ids), [(im.hash, im.num_tokens) for im in admitted.images])
            hashes = prompt_block_hashes(ids, block_size, spans)[:64]
        self._hashed = (admitted, block_size, hashes)
        return hashes


class RedisEncodeLeases:
    """Single-flight encode leases (coordinator/single_flight.py) every shard of one model sees. A claim
    is read in line (only while Redis answers: else granted, costing at most a duplicate encode);
    renewals and releases go on the lane."""

    def __init__(self, store: RedisStore, model_name: str, lane: RedisLane) -> None:
        self.store, self.model_name, self.lane = store, model_name, lane

    def claim(self, image_hash: str, owner: str, ttl_s: float) -> bool:
        if not self.store.responsive():
            return True
        return self.store.claim_lease(self.model_name, image_hash, owner, ttl_s)

    def renew(self, image_hashes: list[str], owner: str, ttl_s: float) -> None:
        self.lane.submit(self.store.renew_leases, self.model_name, list(image_hashes), owner, ttl_s,
                         key=f"renew:{self.model_name}")

    def release(self, image_hashes: list[str], owner: str) -> None:
        self.lane.submit(self.store.release_leases, self.model_name, list(image_hashes), owner)


class CoordinatorRedis:
    """The store, its lane, and what the loop has the lane do every tick."""

    def __init__(self, url: str, *, timeout_s: float, shard_id: str | None, load_poll_s: float) -> None:
        self.lane = RedisLane()
        self.store = RedisStore(url, socket_timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.shard_id = shard_id
        self.registry = ShardRegistry(self.store) if shard_id else None
        self.load_poll_s = load_poll_s
        self.loads: dict[str, dict[str, dict[str, Any]]] | None = None  # the lane's newest read: model -> loads
        self._next_announce = self._next_poll = self._next_probe = 0.0

    def tick(self, now: float, announce: tuple[str, str] | None, started: float,
             workers: Callable[[], dict[str, list[str]]]) -> dict[str, dict[str, dict[str, Any]]] | None:
        """On the loop: queue what is due (announce, the loads of `workers()`, model -> ids; a probe while
        Redis is down); returns the loads the lane read since the last call, model -> worker -> load, to
        apply (None: nothing new)."""
        if self.registry is not None and announce is not None and now >= self._next_announce:
            self._next_announce = now + SHARD_REFRESH_S
            self.lane.submit(partial(self.registry.announce, started=started), self.shard_id, *announce, key="announce")
        if self.load_poll_s > 0 and now >= self._next_poll:
            self._next_poll = now + self.load_poll_s
            self.lane.submit(self._poll_loads, workers(), key="loads")
        elif not self.store.healthy and now >= self._next_probe:  # nothing else would find it back
            self._next_probe = now + PROBE_S
            self.lane.submit(self.store.ping, key="probe")
        loads, self.loads = self.loads, None
        return loads

    def _poll_loads(self, workers: dict[str, list[str]]) -> None:
        self.loads = {model: self.store.get_loads(ids) for model, ids in workers.items()}

    def close(self) -> None:
        """Withdraw the shard's announcement after what is queued; wait a bounded time for Redis."""
        if self.registry is not None:
            self.lane.submit(self.registry.withdraw, self.shard_id)
        self.lane.close(max(2.0, 4 * self.timeout_s))
        self.store.close()
