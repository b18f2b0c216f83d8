"""Event loop and CPU pool of the simulator: pure Python, deterministic (ties broken by insertion order)."""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable


class Loop:
    """A heap of (time, sequence number, callback, args)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._n = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._q, (max(t, self.now), self._n, fn, args))
        self._n += 1

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        q = self._q
        while q:
            if q[0][0] > until:
                self.now = until
                return
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return


class CpuPool:
    """Processes sharing `cores` CPUs (egalitarian processor sharing, at most one core per job).

    Every simulated process (a worker, the coordinator) runs one job at a time, so a job is a
    process's burst of CPU work: with n jobs running each progresses at min(1, cores / n) of its
    stand-alone speed. ``cores=None`` gives every job its own processor (a GPU-class cluster: each
    worker has its accelerator; the coordinator its own core). While the jobs take every core,
    work runs `contention` times slower again (caches, memory bandwidth, context switches of an
    oversubscribed host: measured, `cpu.contention_factor`). `busy_s` accumulates, per owner,
    the stand-alone work submitted, for utilisation figures.
    """

    def __init__(self, loop: Loop, cores: float | None, contention: float = 1.0) -> None:
        self.loop = loop
        self.cores = cores
        self.contention = contention  # work costs this much more while every core is taken
        self._jobs: dict[int, list[Any]] = {}  # id -> [remaining work, callback, owner]
        self._next_id = 0
        self._last = 0.0
        self._version = 0
        self.busy_s: dict[str, float] = {}

    def run(self, work: float, callback: Callable[[], Any], owner: str) -> None:
        work = max(0.0, work)
        self.busy_s[owner] = self.busy_s.get(owner, 0.0) + work
        if self.cores is None:
            self.loop.after(work, callback)
            return
        self._advance()
        self._jobs[self._next_id] = [work, callback, owner]
        self._next_id += 1
        self._reschedule()

    def _speed(self) -> float:
        n = len(self._jobs)
        if not n:
            return 1.0
        return min(1.0, self.cores / n) / (self.contention if n >= self.cores else 1.0)

    def _advance(self) -> None:
        now = self.loop.now
        done = (now - self._last) * self._speed()
        if done > 0:
            for job in self._jobs.values():
                job[0] -= done
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            left = min(job[0] for job in self._jobs.values())
            self.loop.after(max(0.0, left) / self._speed(), self._fire, self._version)

    def _fire(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = [k for k, job in self._jobs.items() if job[0] <= 1e-12]
        callbacks = [self._jobs.pop(k)[1] for k in finished]
        self._reschedule()
        for cb in callbacks:
            cb()
