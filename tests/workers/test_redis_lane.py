"""The Redis lane (common/redis_lane.py): jobs run in order on one thread, submit never waits,
a named job waits at most once, one-off writes past the bound are dropped oldest first, a failing job
does not end the lane, and close waits a bounded time. The prefix index publisher (workers/cache_index.py)
gathers on one thread and sends on another without losing a change made between the two."""

from __future__ import annotations

import threading
import time

from mserve.common.redis_store import RedisStore
from mserve.workers.cache_index import PrefixIndexPublisher
from mserve.common.redis_lane import RedisLane


def _blocked(lane: RedisLane) -> threading.Event:
    """Hold the lane's thread in a job until the returned event is set."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    lane.submit(hold)
    assert started.wait(10)
    return release


def test_jobs_run_in_order_off_the_caller_and_submit_never_waits():
    lane = RedisLane()
    release = _blocked(lane)
    ran: list[tuple[str, int]] = []
    t0 = time.monotonic()
    for i in range(100):
        lane.submit(lambda i: ran.append((threading.current_thread().name, i)), i)
    assert time.monotonic() - t0 < 1.0 and ran == []  # queued behind the held job, not run by the caller
    release.set()
    assert lane.wait_idle(10)
    assert [i for _, i in ran] == list(range(100))
    assert {name for name, _ in ran} == {"mserve-redis"}
    assert lane.close(1)


def test_a_named_job_waits_once_in_its_first_place_with_the_newest_call():
    lane = RedisLane()
    release = _blocked(lane)
    ran: list[object] = []
    lane.submit(ran.append, "load-1", key="heartbeat")
    lane.submit(ran.append, "write-a")
    lane.submit(ran.append, "load-2", key="heartbeat")  # replaces load-1, keeps its place
    lane.submit(ran.append, "write-b")
    assert lane.pending() == 4  # the held job and three waiting
    release.set()
    assert lane.wait_idle(10)
    assert ran == ["load-2", "write-a", "write-b"]
    lane.submit(ran.append, "load-3", key="heartbeat")  # once run, the key queues again
    assert lane.close(10) and ran[-1] == "load-3"


def test_past_the_bound_the_oldest_writes_are_dropped_and_named_jobs_stay():
    lane = RedisLane(max_queued=5)
    release = _blocked(lane)
    ran: list[object] = []
    lane.submit(ran.append, "beat", key="heartbeat")
    for i in range(10):
        lane.submit(ran.append, i)
    assert lane.dropped == 6
    release.set()
    assert lane.close(10)
    assert ran == ["beat", 6, 7, 8, 9]


def test_a_failing_job_does_not_end_the_lane(caplog):
    lane = RedisLane()
    ran: list[int] = []
    lane.submit(lambda: 1 / 0)
    lane.submit(ran.append, 1)
    assert lane.close(10) and ran == [1]
    assert any("redis job" in r.getMessage() for r in caplog.records)


def test_close_waits_a_bounded_time_then_drops_what_is_left():
    lane = RedisLane()
    release = _blocked(lane)
    ran: list[int] = []
    lane.submit(ran.append, 1)
    t0 = time.monotonic()
    assert not lane.close(0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    lane.submit(ran.append, 2)  # closed: nothing more is taken
    release.set()
    lane._thread.join(10)  # the held job ends, and the lane with it: what was dropped never ran
    assert not lane._thread.is_alive() and ran == []


class _Pool:
    """What the publisher reads of a KV pool: the changes since the last take, and what it holds."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.changes: dict[str, bool] = {}

    def hold(self, h: str, held: bool) -> None:
        (self.held.add if held else self.held.discard)(h)
        self.changes[h] = held

    def take_index_changes(self) -> dict[str, bool]:
        out, self.changes = self.changes, {}
        return out

    def cached_hashes(self) -> list[str]:
        return sorted(self.held)


class _MidSend(RedisStore):
    """A real store that runs `during` while its prefix update is on the wire (another thread's change)."""

    during = staticmethod(lambda: None)

    def update_prefix_blocks(self, *args, **kwargs) -> bool:
        self.during()
        return super().update_prefix_blocks(*args, **kwargs)


def test_a_change_gathered_while_a_send_is_out_is_sent_next_time(redis_url):
    store = _MidSend(redis_url)
    pool = _Pool()
    pub = PrefixIndexPublisher(store, "m", "w0", pool, every_s=0)
    pool.hold("a", True)
    pool.hold("b", True)
    pub.collect(1.0)

    def evict_a() -> None:  # the loop evicts "a" while the lane sends its add
        pool.hold("a", False)
        pub.collect(2.0)

    store.during = evict_a
    assert not pub.send()  # sent the add; the removal waits
    assert pub.pending == {"a": False}
    store.during = staticmethod(lambda: None)
    assert pub.send() and not pub.pending
    assert store.prefix_blocks_of("m", "w0") == {"b"}
    assert pub.published == 2 and pub.removed == 1
    store.close()
