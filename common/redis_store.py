"""Cluster metadata in Redis: worker registry, load, counters; the embedding and prefix indexes and the
encode leases come with it from common/redis_indexes.py."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from mserve.common.redis_indexes import CacheIndexes, _glob_escape, _ms

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WORKER_TTL_S = 3.0
SOCKET_TIMEOUT_S = 0.5
# While Redis is down, only one call per interval pays for a connection attempt;
# the rest answer from cache immediately, so a black-holed host can't stall callers.
RETRY_INTERVAL_S = 1.0
# A call out this long makes the store unresponsive (`responsive`): a Redis round trip here is well under
# a millisecond, and a loop that must not wait skips Redis until the call that is stuck ends.
STUCK_S = 0.1

# InvalidResponse: something that isn't Redis answers at the URL (a proxy, a
# half-started server); to the caller that is as much an outage as a refusal.
_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, InvalidResponse)
# Worker info is free-form strings in Redis; these schema fields get their type back.
_WORKER_FIELD_TYPES: dict[str, type] = {"pid": int, "started_at": float}
_INT_RE = re.compile(r"[-+]?\d+")
# Stricter than float(): "nan"/"inf" stay strings.
_FLOAT_RE = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


def _to_redis(mapping: Mapping[str, Any]) -> dict[str, str]:
    # None means "not known": storing "None" would read back as a real value.
    return {
        str(k): str(int(v)) if isinstance(v, bool) else str(v)
        for k, v in mapping.items() if v is not None
    }


def _number(v: str) -> int | float | str:
    if _INT_RE.fullmatch(v):
        return int(v)
    if _FLOAT_RE.fullmatch(v):
        return float(v)
    return v


def _worker_info(raw: Mapping[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = dict(raw)
    for field, typ in _WORKER_FIELD_TYPES.items():
        if field in info:
            with contextlib.suppress(ValueError):  # a non-number comes back as stored
                info[field] = typ(info[field])
    return info


# Compare-and-set scripts: only the lease's owner keeps, renews or drops it.


class RedisStore(CacheIndexes):
    """Typed access to the cluster's shared metadata, tolerant of Redis outages.

    Every public method swallows connection/timeout errors: reads then return
    the last good answer (workers, loads) or an empty one (indexes, counters),
    writes are dropped, and ``healthy`` turns False until a call succeeds again.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "mserve:",
        *,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
    ) -> None:
        self.prefix = prefix
        self.retry_interval_s = retry_interval_s
        self.state_losses = 0  # times a registration we kept alive had vanished (restart / FLUSHALL)
        self.recoveries = 0  # times Redis answered again after an outage, whose writes were dropped
        # One retry without backoff lets a pooled connection that went stale across
        # a server restart reconnect; redis-py's default (10 backed-off retries)
        # would stall every call for seconds during an outage. Timeouts are not
        # retried: the write may have landed (HINCRBY twice) and it doubles the stall.
        self._pool = redis.ConnectionPool.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._r = redis.Redis(connection_pool=self._pool)
        kw = self._pool.connection_kwargs  # for log lines: never log the password
        self._where = f"{kw.get('host', kw.get('path'))}:{kw.get('port')}/{kw.get('db', 0)}"
        self._lock = threading.Lock()
        self._healthy = True
        self._inflight: dict[int, float] = {}  # thread id -> when its current call started
        self._down_since = 0.0
        self._next_probe = 0.0
        self._workers_cache: dict[str, dict[str, Any]] = {}
        self._loads_cache: dict[str, dict[str, Any]] = {}
        # What this process registered, so heartbeat() can re-create it after
        # the key vanished (expiry during a stall, or a Redis restart).
        self._registered: dict[str, tuple[dict[str, str], float]] = {}

    # ---- plumbing -------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def responsive(self, stuck_s: float = STUCK_S) -> bool:
        """Healthy, and no call on any thread out longer than `stuck_s`. A thread that must not wait on
        Redis (the coordinator's loop) calls it only then, and leaves noticing a stall, and probing
        while it lasts, to calls on another thread (its Redis lane, common/redis_lane.py)."""
        if not self._healthy:
            return False
        now = time.monotonic()
        with self._lock:
            return all(now - t < stuck_s for t in self._inflight.values())

    def _call(self, op: Callable[[], T], fallback: Callable[[], T]) -> T:
        if not self._healthy and time.monotonic() < self._next_probe:
            return fallback()
        me = threading.get_ident()
        with self._lock:
            self._inflight[me] = time.monotonic()
        try:
            result = op()
        except _OUTAGE_ERRORS as e:
            self._mark_down(e)
            return fallback()
        finally:
            with self._lock:
                self._inflight.pop(me, None)
        if not self._healthy:
            self._mark_up()
        return result

    def _mark_down(self, err: Exception) -> None:
        with self._lock:
            self._next_probe = time.monotonic() + self.retry_interval_s
            if not self._healthy:
                return
            self._healthy = False
            self._down_since = time.monotonic()
        logger.warning(
            "redis unreachable at %s (%s): degraded mode, reads served from cache, "
            "writes dropped", self._where, err,
        )

    def _mark_up(self) -> None:
        with self._lock:
            if self._healthy:
                return
            self._healthy = True
            self.recoveries += 1
            outage = time.monotonic() - self._down_since
        logger.warning("redis back at %s after %.1fs", self._where, outage)

    def ping(self) -> bool:
        return self._call(lambda: bool(self._r.ping()), lambda: False)

    def close(self) -> None:
        self._r.close()
        self._pool.disconnect()

    # ---- worker registry ------------------------------------------------

    def register_worker(
        self, worker_id: str, info: Mapping[str, Any], ttl_s: float = DEFAULT_WORKER_TTL_S
    ) -> bool:
        fields = _to_redis(info)
        # Remembered even if Redis is down now: the next heartbeat registers it.
        self._registered[worker_id] = (fields, ttl_s)
        return self._call(lambda: self._write_worker(worker_id, fields, ttl_s), lambda: False)

    def _write_worker(self, worker_id: str, fields: dict[str, str], ttl_s: float) -> bool:
        # An empty hash would not exist at all, so a bare registration needs a field.
        key = self._k("worker", worker_id)
        return self._replace_hash(key, fields or {"registered": "1"}, ttl_s)

    def _replace_hash(self, key: str, fields: dict[str, str], ttl_s: float) -> bool:
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(key)  # fields of an earlier write must not outlive this one
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, _ms(ttl_s))
        pipe.execute()
        return True

    def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> bool:
        """Refresh the worker's TTL; re-register it if its key is gone. False if not live."""
        known = self._registered.get(worker_id)
        ttl = ttl_s if ttl_s is not None else (known[1] if known else DEFAULT_WORKER_TTL_S)

        def op() -> bool:
            if self._r.pexpire(self._k("worker", worker_id), _ms(ttl)):
                return True
            if known is None:
                return False
            # Our key is gone though we kept it alive: Redis restarted empty or was flushed. Whoever
            # watches state_losses republishes what it had indexed.
            self.state_losses += 1
            return self._write_worker(worker_id, known[0], ttl)

        return self._call(op, lambda: False)

    def deregister_worker(self, worker_id: str) -> bool:
        self._registered.pop(worker_id, None)
        self._workers_cache.pop(worker_id, None)
        self._loads_cache.pop(worker_id, None)
        keys = (self._k("worker", worker_id), self._k("load", worker_id))
        return self._call(lambda: self._r.delete(*keys) >= 0, lambda: False)

    def list_workers(self, role: str | None = None) -> dict[str, dict[str, Any]]:
        """Live workers by id, optionally of one role; the last good answer while Redis is down."""
        workers = self._call(self._read_workers, lambda: self._workers_cache)
        return {w: dict(i) for w, i in workers.items() if role is None or i.get("role") == role}

    def _read_workers(self) -> dict[str, dict[str, Any]]:
        head = self._k("worker", "")
        keys = list(self._r.scan_iter(match=_glob_escape(head) + "*", count=500))
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        workers: dict[str, dict[str, Any]] = {}
        for key, raw in zip(keys, pipe.execute()):
            if raw:  # empty: expired between SCAN and HGETALL
                workers[key[len(head):]] = _worker_info(raw)
        self._workers_cache = workers
        return workers

    # ---- load -----------------------------------------------------------

    def publish_load(
        self, worker_id: str, load: Mapping[str, Any], ttl_s: float = DEFAULT_WORKER_TTL_S
    ) -> bool:
        fields = _to_redis(load)
        fields.setdefault("updated_at", repr(time.time()))
        key = self._k("load", worker_id)
        return self._call(lambda: self._replace_hash(key, fields, ttl_s), lambda: False)

    def get_loads(self, worker_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Load of each listed worker that has published recently (numbers parsed)."""
        ids = list(worker_ids)

        def op() -> dict[str, dict[str, Any]]:
            pipe = self._r.pipeline(transaction=False)
            for w in ids:
                pipe.hgetall(self._k("load", w))
            loads: dict[str, dict[str, Any]] = {}
            for w, raw in zip(ids, pipe.execute()):
                if raw:
                    loads[w] = {f: _number(v) for f, v in raw.items()}
                    self._loads_cache[w] = loads[w]
                else:
                    self._loads_cache.pop(w, None)  # expired: the worker stopped reporting
            return loads

        cache = self._loads_cache
        return self._call(op, lambda: {w: dict(cache[w]) for w in ids if w in cache})

    # ---- counters -------------------------------------------------------

    def incr_counter(self, name: str, worker_id: str, n: int = 1) -> int | None:
        """New counter value, or None if the increment was dropped (Redis down)."""
        key = self._k("counter", worker_id)
        return self._call(lambda: int(self._r.hincrby(key, name, n)), lambda: None)

    def get_counters(self, worker_id: str) -> dict[str, int]:
        key = self._k("counter", worker_id)
        return self._call(lambda: {k: int(v) for k, v in self._r.hgetall(key).items()}, dict)

    # ---- census (read-only, for `mserve status`) ------------------------

    def census(self) -> dict[str, dict[str, Any]] | None:
        """Index entries per model name ("emb": images, "prefix": blocks) and every worker's counters
        ("counters"), from one SCAN over this store's keys (never KEYS). None while Redis is down."""

        def op() -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {"emb": {}, "prefix": {}, "counters": {}}
            counter_keys = []
            for key in self._r.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
                kind, _, rest = key[len(self.prefix):].partition(":")
                if kind in ("emb", "prefix") and ":" in rest:
                    model = rest.rsplit(":", 1)[0]  # the block / image hash is hex, the model may hold ':'
                    out[kind][model] = out[kind].get(model, 0) + 1
                elif kind == "counter":
                    counter_keys.append(key)
            pipe = self._r.pipeline(transaction=False)
            for key in counter_keys:
                pipe.hgetall(key)
            for key, raw in zip(counter_keys, pipe.execute()):
                if raw:
                    out["counters"][key[len(self._k("counter", "")):]] = {k: _number(v) for k, v in raw.items()}
            return out

        return self._call(op, lambda: None)
