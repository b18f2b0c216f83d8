"""The fetch pool: results come back per key in submission order, a forgotten key's results are
released and never admitted, and in-flight counts cover every job until it returns."""

from __future__ import annotations

import threading

from mserve.workers.fetcher import FetchJob, FetchPool
from tests.helpers import wait_for


def collect(pool: FetchPool, out: list) -> None:
    for job in pool.ready():
        if job.error is None:
            job.admit(job.result)
        else:
            job.fail(job.error)


def job(key, value, out, gate: threading.Event | None = None, released: list | None = None,
        error: Exception | None = None) -> FetchJob:
    def fetch():
        if gate is not None:
            assert gate.wait(10)
        if error is not None:
            raise error
        return value

    return FetchJob(key, fetch, admit=lambda v: out.append((key, v)), fail=lambda e: out.append((key, repr(e))),
                    release=(released.append if released is not None else None))


def test_one_keys_jobs_come_back_in_order_and_other_keys_do_not_wait():
    pool, out = FetchPool(threads=3), []
    try:
        slow = threading.Event()
        pool.submit(job("a", 1, out, gate=slow))  # a's first fetch stalls...
        pool.submit(job("a", 2, out))  # ...its second is done at once, but waits its turn
        pool.submit(job("b", 3, out, error=TimeoutError("no reply")))
        wait_for(lambda: (collect(pool, out), ("b", "TimeoutError('no reply')") in out)[1], what="b's failure")
        assert out == [("b", "TimeoutError('no reply')")] and pool.in_flight() == 1 and pool.holds("a")
        slow.set()
        wait_for(lambda: (collect(pool, out), len(out) == 3)[1], what="a's two jobs")
        assert out[1:] == [("a", 1), ("a", 2)] and pool.in_flight() == 0 and not pool.holds("a")
    finally:
        pool.close()


def test_a_forgotten_keys_results_are_released_not_admitted_and_count_until_back():
    pool, out, released = FetchPool(threads=2), [], []
    try:
        gate = threading.Event()
        pool.submit(job("r", "view-1", out, gate=gate, released=released))
        pool.submit(job("r", "view-2", out, released=released))
        # The second comes back, but behind the stalled first: not admitted.
        wait_for(lambda: (collect(pool, out), pool.in_flight() == 1)[1], what="the second job back")
        assert out == []
        assert pool.forget("r") == 2 and released == ["view-2"]  # cancel: what came is released at once
        assert pool.in_flight() == 1  # the stalled fetch still counts (a drain waits for it)
        pool.submit(job("r", "attempt-2", out))  # a newer attempt does not wait behind the old one
        wait_for(lambda: (collect(pool, out), out == [("r", "attempt-2")])[1], what="the newer attempt")
        gate.set()
        wait_for(lambda: (collect(pool, out), pool.in_flight() == 0)[1], what="the stalled fetch back")
        assert released == ["view-2", "view-1"] and out == [("r", "attempt-2")]
    finally:
        pool.close()
