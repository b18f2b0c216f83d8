"""The coordinator's per-stage class queues: the order requests are served in, with an explicit clock."""

from __future__ import annotations

from mserve.coordinator.records import Stage
from mserve.coordinator.routing import WorkerView
from mserve.coordinator.stage_queues import StageQueues, class_name, takers

AGING = 10.0


def queues(*entries: tuple[str, int, str, float], stage: Stage = Stage.PREFILL) -> StageQueues:
    """A StageQueues with (rid, priority, latency_class, since) pushed in the order given."""
    q = StageQueues(aging_s=AGING)
    for rid, priority, latency_class, since in entries:
        q.push(rid, stage, priority=priority, latency_class=latency_class, since=since)
    return q


def order(q: StageQueues, now: float, stage: Stage = Stage.PREFILL) -> list[str]:
    """The serving order, popping one at a time as the request machine does (and checking `ordered` agrees)."""
    planned = [w.rid for w in q.ordered(stage, now)]
    popped = []
    while (w := q.first(stage, now)) is not None:
        popped.append(w.rid)
        assert q.discard(w.rid) == w
    assert popped == planned
    return popped


def test_priority_first_then_interactive_before_batch_then_fifo():
    q = queues(("b-old", 0, "batch", 0.0), ("i-new", 0, "interactive", 3.0), ("b-vip", 1, "batch", 4.0),
               ("i-old", 0, "interactive", 1.0), ("low", -1, "interactive", 0.5), ("b-new", 0, "batch", 2.0))
    assert order(q, now=5.0) == ["b-vip", "i-old", "i-new", "b-old", "b-new", "low"]


def test_ties_break_by_push_order_deterministically():
    q = queues(("c", 0, "batch", 1.0), ("a", 0, "batch", 1.0), ("b", 0, "batch", 1.0))
    assert order(q, now=1.0) == ["c", "a", "b"]


def test_a_request_waiting_longer_than_the_aging_time_goes_before_every_class():
    entries = [("b-0", 0, "batch", 0.0), ("b-1", 0, "batch", 1.0), ("vip", 5, "interactive", 8.0),
               ("i", 0, "interactive", 9.0)]
    assert order(queues(*entries), now=AGING) == ["vip", "i", "b-0", "b-1"]  # nobody older than AGING yet
    # b-0 has waited 10.5 s (aged), b-1 9.5 s (not yet): b-0 overtakes every class, b-1 does not.
    assert order(queues(*entries), now=10.5) == ["b-0", "vip", "i", "b-1"]
    # Both aged: oldest first among the aged, whatever their class.
    entries.append(("vip-aged", 9, "interactive", 0.5))
    assert order(queues(*entries), now=12.0) == ["b-0", "vip-aged", "b-1", "vip", "i"]


def test_stages_are_separate_queues_and_a_push_to_another_stage_moves_the_request():
    q = StageQueues(aging_s=AGING)
    q.push("a", Stage.ENCODE, priority=0, latency_class="batch", since=0.0)
    q.push("b", Stage.PREFILL, priority=0, latency_class="batch", since=1.0)
    assert [w.rid for w in q.ordered(Stage.ENCODE, 2.0)] == ["a"] and q.first(Stage.PREFILL, 2.0).rid == "b"
    assert q.first(Stage.DECODE, 2.0) is None and len(q) == 2 and "a" in q
    q.push("a", Stage.PREFILL, priority=0, latency_class="batch", since=0.0)  # encoded: now it waits for prefill
    assert q.first(Stage.ENCODE, 2.0) is None and [w.rid for w in q.ordered(Stage.PREFILL, 2.0)] == ["a", "b"]
    assert len(q) == 2


def test_pushing_again_at_the_same_stage_keeps_the_place():
    q = queues(("a", 0, "batch", 0.0), ("b", 0, "batch", 1.0))
    q.push("a", Stage.PREFILL, priority=0, latency_class="batch", since=5.0)
    assert q.first(Stage.PREFILL, 5.0).since == 0.0
    assert order(q, now=5.0) == ["a", "b"]


def test_discard_and_counts_per_stage_and_class():
    q = queues(("i1", 0, "interactive", 0.0), ("b1", 0, "batch", 0.0), ("b2", 0, "batch", 0.0),
               ("vip", 2, "batch", 0.0))
    q.push("e1", Stage.ENCODE, priority=0, latency_class="interactive", since=0.0)
    assert q.counts() == {"encode": {"interactive": 1}, "prefill": {"batch/p2": 1, "interactive": 1, "batch": 2}}
    assert list(q.counts()["prefill"]) == ["batch/p2", "interactive", "batch"]  # best class first
    assert q.discard("b1").rid == "b1" and q.discard("b1") is None and q.discard("never") is None
    assert q.discard("e1") is not None
    assert q.counts() == {"prefill": {"batch/p2": 1, "interactive": 1, "batch": 1}} and len(q) == 3
    assert class_name(-1, "interactive") == "interactive/p-1"


def test_takers_are_the_live_workers_of_the_role_under_the_cap_and_decode_is_never_capped():
    ws = [WorkerView("p0", "prefill", inflight=2), WorkerView("p1", "prefill", inflight=1),
          WorkerView("p2", "prefill", alive=False), WorkerView("d0", "decode", inflight=9),
          WorkerView("u0", "unified", inflight=1)]
    assert [w.worker_id for w in takers(ws, Stage.PREFILL, cap=0)] == ["p0", "p1"]
    assert [w.worker_id for w in takers(ws, Stage.PREFILL, cap=2)] == ["p1"]
    assert takers(ws, Stage.PREFILL, cap=1) == [] and takers(ws, Stage.RUN, cap=1) == []
    assert [w.worker_id for w in takers(ws, Stage.DECODE, cap=1)] == ["d0"]
    assert takers(ws, Stage.START, cap=0) == [] and takers(ws, Stage.ENCODE, cap=0) == []
