"""Transfer fetches off the worker loop: IO threads pull a stage's KV / embeddings while the loop steps.

A fetch waits on another worker (up to the worker's `fetch_timeout_s` when that worker stalls); on the loop thread
that wait would stall every running decode. Here the loop only submits a job and, each turn, takes
the finished ones (`ready`) and admits their requests. Jobs of one key (a request id) come back in
the order they were submitted, whichever thread finished first: a prefill's late EMBEDDINGS never
overtake its PREFILL. `forget(key)` (cancel, failure, a newer attempt) drops a key's jobs; what
their fetches still bring is handed to the job's `release` (an shm view's ack) and never admitted.

The threads share nothing with the loop but the two queues: TransferEngine.fetch is safe from any
thread (each thread gets its own zmq sockets, common/transfer/channel.py), and every callback the
job carries except `fetch` runs on the loop thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from mserve.common.cpu_placement import on_io_cores

log = logging.getLogger("mserve.worker")

# Enough that a stalled sender or two (each holds a thread for up to fetch_timeout_s) leave the others
# a thread; the threads mostly wait on sockets.
FETCH_THREADS = 4


@dataclass(eq=False)
class FetchJob:
    key: Hashable  # jobs of one key are handed back in submission order
    fetch: Callable[[], Any]  # on an IO thread: the transfer(s); its result (or exception) comes back
    admit: Callable[[Any], None]  # on the loop: use the result
    fail: Callable[[BaseException], None]  # on the loop: the fetch raised
    release: Callable[[Any], None] | None = None  # on the loop: a result no one admits (forgotten key)
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    forgotten: bool = field(default=False, repr=False)


class FetchPool:
    def __init__(self, threads: int = 2, name: str = "fetch") -> None:
        self._jobs: queue.SimpleQueue[FetchJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[FetchJob] = queue.SimpleQueue()
        self._by_key: dict[Hashable, deque[FetchJob]] = {}  # the loop's alone
        self._running = 0  # submitted, not yet collected by `ready` (forgotten ones included)
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        on_io_cores()  # off the model's core where the worker has IO cores (common/cpu_placement.py)
        while (job := self._jobs.get()) is not None:
            try:
                job.result = job.fetch()
            except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the loop
                job.error = exc
            self._done.put(job)

    # -- on the loop thread ----------------------------------------------------------------------------
    def submit(self, job: FetchJob) -> None:
        self._by_key.setdefault(job.key, deque()).append(job)
        self._running += 1
        self._jobs.put(job)

    def forget(self, key: Hashable) -> int:
        """Drop the key's jobs (their results are released when they come); how many were dropped."""
        jobs = self._by_key.pop(key, None) or ()
        for job in jobs:
            job.forgotten = True
            if job.done:  # back already, waiting behind an earlier job of its key
                self._release(job)
        return len(jobs)

    def holds(self, key: Hashable) -> bool:
        """The key has a job not yet admitted: what it submits next must queue behind it."""
        return key in self._by_key

    def keys(self) -> list[Hashable]:
        return list(self._by_key)

    def in_flight(self) -> int:
        """Jobs submitted and not yet handed back or released (forgotten ones count until they return:
        a drain waits for them so no fetch outlives the worker's sockets)."""
        return self._running

    def ready(self) -> Iterator[FetchJob]:
        """Take finished fetches; yield, per key in submission order, the jobs now at the head of their key
        with their result in. The caller admits (or fails) each one."""
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            self._running -= 1
            job.done = True
            if job.forgotten:
                self._release(job)
                continue
            jobs = self._by_key.get(job.key)
            # Re-checked after each yield: admitting one job may forget its key (a failure ends the request).
            while jobs and jobs[0].done and not jobs[0].forgotten:
                head = jobs.popleft()
                if not jobs and self._by_key.get(head.key) is jobs:
                    del self._by_key[head.key]
                yield head

    @staticmethod
    def _release(job: FetchJob) -> None:
        if job.error is None and job.release is not None:
            try:
                job.release(job.result)
            except Exception:  # a failed ack costs the sender a segment until its expiry, nothing here
                log.exception("%s: releasing a forgotten fetch failed", job.key)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the threads; one still inside a fetch ends with it (they are daemons)."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout_s)
