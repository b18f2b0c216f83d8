"""The cluster's cache indexes in Redis, as a part of RedisStore (common/redis_store.py): which workers
hold an image's embeddings ("emb"), which hold a prompt's prefix blocks ("prefix"), and the encode
leases of single-flight encodes ("encoding", coordinator/single_flight.py).

Each index is a set of worker ids per key, with a TTL that its writers refresh (workers/cache_index.py),
so a worker that dies without cleaning up drops out. Every call goes through the store's `_call`:
outage-tolerant like the rest of it (reads answer empty, writes are dropped, a lease is granted).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from mserve.common.prefix_rules import leading_run

T = TypeVar("T")

DEFAULT_INDEX_TTL_S = 600.0

_CLAIM = ("if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end "
          "if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end "
          "return 0")
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def _ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


class CacheIndexes:
    """The index methods of RedisStore, which provides `_r` (the client), `_k` (a key under its prefix)
    and `_call` (a call that survives an outage)."""

    _r: Any

    def _k(self, *parts: str) -> str:
        raise NotImplementedError

    def _call(self, op: Callable[[], T], fallback: Callable[[], T]) -> T:
        raise NotImplementedError

    # ---- embedding index ------------------------------------------------

    def add_embeddings(self, model: str, image_hashes: Iterable[str], worker_id: str,
                       ttl_s: float = DEFAULT_INDEX_TTL_S) -> bool:
        return self._update_sets([self._k("emb", model, h) for h in image_hashes], worker_id, ttl_s)

    def add_embedding(
        self, model: str, image_hash: str, worker_id: str, ttl_s: float = DEFAULT_INDEX_TTL_S
    ) -> bool:
        return self._update_sets([self._k("emb", model, image_hash)], worker_id, ttl_s)

    def lookup_embedding(self, model: str, image_hash: str) -> set[str]:
        return self._call(lambda: set(self._r.smembers(self._k("emb", model, image_hash))), set)

    def remove_embedding(self, model: str, image_hash: str, worker_id: str) -> bool:
        return self._update_sets([self._k("emb", model, image_hash)], worker_id, None)

    def drop_worker_embeddings(self, worker_id: str, model: str, hashes: Iterable[str]) -> bool:
        return self._update_sets([self._k("emb", model, h) for h in hashes], worker_id, None)

    # ---- prefix-block index ---------------------------------------------

    def add_prefix_blocks(
        self, model: str, worker_id: str, hashes: Iterable[str], ttl_s: float = DEFAULT_INDEX_TTL_S
    ) -> bool:
        return self._update_sets([self._k("prefix", model, h) for h in hashes], worker_id, ttl_s)

    def match_prefix(self, model: str, hashes: list[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it holds (>= 1)."""
        if not hashes:
            return {}

        def op() -> dict[str, int]:
            pipe = self._r.pipeline(transaction=False)
            for h in hashes:
                pipe.smembers(self._k("prefix", model, h))
            return leading_run(pipe.execute())

        return self._call(op, dict)

    def remove_prefix_blocks(self, model: str, worker_id: str, hashes: Iterable[str]) -> bool:
        return self._update_sets([self._k("prefix", model, h) for h in hashes], worker_id, None)

    def update_prefix_blocks(self, model: str, worker_id: str, add: Iterable[str], remove: Iterable[str],
                             ttl_s: float = DEFAULT_INDEX_TTL_S) -> bool:
        """One round trip: index `add` as held by the worker, and forget `remove` for it."""
        add, remove = list(add), list(remove)
        if not add and not remove:
            return True

        def op() -> bool:
            pipe = self._r.pipeline(transaction=False)
            for h in remove:
                pipe.srem(self._k("prefix", model, h), worker_id)
            for h in add:
                key = self._k("prefix", model, h)
                pipe.sadd(key, worker_id)
                pipe.pexpire(key, _ms(ttl_s))
            pipe.execute()
            return True

        return self._call(op, lambda: False)

    def prefix_blocks_of(self, model: str, worker_id: str) -> set[str]:
        """Every block hash the index says `worker_id` holds (a SCAN: for checks and status, not routing)."""
        def op() -> set[str]:
            keys = list(self._r.scan_iter(match=self._k("prefix", _glob_escape(model), "*"), count=1000))
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.sismember(key, worker_id)
            start = len(self._k("prefix", model, ""))
            return {k[start:] for k, held in zip(keys, pipe.execute()) if held}

        return self._call(op, set)

    def _update_sets(self, keys: list[str], member: str, ttl_s: float | None) -> bool:
        """Add ``member`` to each set (refreshing its TTL), or remove it when ttl_s is None."""
        if not keys:
            return True

        def op() -> bool:
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                if ttl_s is None:
                    pipe.srem(key, member)
                else:
                    pipe.sadd(key, member)
                    pipe.pexpire(key, _ms(ttl_s))
            pipe.execute()
            return True

        return self._call(op, lambda: False)

    # ---- encode leases (single-flight encodes, coordinator/single_flight.py) ----

    def claim_lease(self, model: str, image_hash: str, owner: str, ttl_s: float) -> bool:
        """Take (or keep, when `owner` has it) the image's encode lease for ttl_s. Redis down: granted,
        so an outage costs at most a duplicate encode, never a request stuck behind a lease."""
        key = self._k("encoding", model, image_hash)
        return self._call(lambda: bool(self._r.eval(_CLAIM, 1, key, owner, _ms(ttl_s))), lambda: True)

    def renew_leases(self, model: str, image_hashes: Iterable[str], owner: str, ttl_s: float) -> None:
        self._each_lease(model, image_hashes, owner, _RENEW, _ms(ttl_s))

    def release_leases(self, model: str, image_hashes: Iterable[str], owner: str) -> None:
        self._each_lease(model, image_hashes, owner, _RELEASE)

    def _each_lease(self, model: str, image_hashes: Iterable[str], owner: str, script: str, *args: Any) -> None:
        def op() -> None:
            pipe = self._r.pipeline(transaction=False)
            for h in image_hashes:
                pipe.eval(script, 1, self._k("encoding", model, h), owner, *args)
            pipe.execute()

        self._call(op, lambda: None)
