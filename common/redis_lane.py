"""Redis calls on one thread of their own, so the thread that serves (a worker's loop and heartbeat
thread, the coordinator's loop) only queues them.

A Redis call may wait up to the store's socket timeout (`--redis-timeout-s`), and a stalled Redis makes
every probe wait that long. On a worker's loop that wait held every running decode; on its pulse thread,
the coordinator's heartbeats; on the coordinator's loop, every stream. Here it delays only what Redis is
for: cache indexes, registrations and loads, the shard registry, encode leases.

Two kinds of job, run one at a time in the order they were queued:
- a named job (`key`): a heartbeat with the load, the prefix index publish, a registry read or
  announce, the loads poll. At most one of each waits; queueing it again while it waits keeps the
  earlier place and runs the newer call, so a stall never piles them up (each reads its state when it
  runs, or carries the newest).
- a one-off write (embedding index adds and removals, counters, lease releases). When more than
  `max_queued` wait (Redis stalled under heavy traffic), the oldest are dropped and counted: those
  writes are hints that expire, and a worker republishes its indexes after an outage or a Redis that
  came back empty.

Users: workers/worker_redis.py, coordinator/coordinator_redis.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mserve.common.cpu_placement import on_io_cores

log = logging.getLogger(__name__)  # mserve.common.redis_lane, in the worker and the coordinator alike

MAX_QUEUED = 4096


class RedisLane:
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self._jobs: deque[list[Any]] = deque()  # [key, fn, args]; a named job's list is updated in place
        self._named: dict[str, list[Any]] = {}  # key -> its waiting job
        self._cond = threading.Condition()
        self._running = False  # a job is out of the queue and running
        self._closed = False
        self.dropped = 0  # one-off writes dropped while Redis could not keep up
        self._next_drop_log = 0.0
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any, key: str | None = None) -> None:
        """Queue `fn(*args)` for the lane's thread; never waits. Named (`key`): replaces the same
        key's waiting call, if any, in its place."""
        with self._cond:
            if self._closed:
                return
            if key is not None and (waiting := self._named.get(key)) is not None:
                waiting[1], waiting[2] = fn, args
                return
            job = [key, fn, args]
            if key is not None:
                self._named[key] = job
            self._jobs.append(job)
            self._trim()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mserve-redis", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _trim(self) -> None:
        """Drop the oldest one-off writes past `max_queued` (named jobs stay)."""
        excess = len(self._jobs) - self.max_queued
        if excess <= 0:
            return
        kept: deque[list[Any]] = deque()
        for job in self._jobs:
            if excess > 0 and job[0] is None:
                excess -= 1
                self.dropped += 1
            else:
                kept.append(job)
        self._jobs = kept
        if time.monotonic() >= self._next_drop_log:
            self._next_drop_log = time.monotonic() + 60.0
            log.warning("redis is not keeping up: %d index write(s) dropped so far (indexes are hints; they are "
                        "republished after an outage)", self.dropped)

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._jobs) + self._running

    def _run(self) -> None:
        on_io_cores()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                key, fn, args = job = self._jobs.popleft()
                if key is not None and self._named.get(key) is job:
                    del self._named[key]
                self._running = True
            try:
                fn(*args)
            except Exception:  # a bug in one job must not end the lane; the store itself swallows outages
                log.exception("redis job %s failed", key or getattr(fn, "__name__", fn))
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued job has run; False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float) -> bool:
        """Run what is queued (at most `timeout_s`), then stop. False when some was left unrun."""
        done = self.wait_idle(timeout_s)
        with self._cond:
            self._closed = True
            if not done:
                log.warning("worker exits with %d redis write(s) unsent (redis slow or down); their entries "
                            "expire by TTL", len(self._jobs) + self._running)
                self._jobs.clear()
                self._named.clear()
            self._cond.notify_all()
        return done
