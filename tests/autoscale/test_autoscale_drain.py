"""Draining without processes: the coordinator's side (request machine, hand-made worker messages, a
clock the test moves) and the worker's bookkeeping (workers/draining.py)."""

from __future__ import annotations

from mserve.common.protocol import MsgType
from mserve.workers.draining import Drain
from tests.coordinator.test_request_machine import Harness, make_admitted, only


def drain(h: Harness, wid: str) -> list:
    """The heartbeat of a worker that got SIGTERM."""
    return h.worker(wid, MsgType.HEARTBEAT, worker_id=wid, load={"draining": True, "at": h.t + 1000})


def shutdowns(out: list) -> list[str]:
    return [m.worker_id for m in out if m.kind is MsgType.SHUTDOWN]


def test_a_draining_decode_worker_gets_nothing_new_finishes_its_request_then_shutdown():
    h = Harness(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    out = h.submit(make_admitted("a"))
    pre = only(out, MsgType.PREFILL, "p0")
    dec_a = only(h.prefilled("p0", pre, 7), MsgType.DECODE)
    victim, other = dec_a.worker_id, ({"d0", "d1"} - {dec_a.worker_id}).pop()
    assert shutdowns(drain(h, victim)) == []
    status = h.m.status()["workers"]
    assert status[victim]["draining"] is True and status[victim]["alive"] is True
    assert status[other]["draining"] is False
    # New requests avoid it, even with the other decode worker busier.
    for rid in ("b", "c"):
        pre = only(h.submit(make_admitted(rid)), MsgType.PREFILL, "p0")
        assert only(h.prefilled("p0", pre, 7), MsgType.DECODE).worker_id == other
    assert shutdowns(h.advance(1.0, beating=("p0", "d0", "d1"))) == []  # request a still runs there
    done = h.step(victim, dec_a, [8, 9], finished=True)
    assert only(done, MsgType.RESULT).body["token_ids"] == [7, 8, 9]
    out = h.advance(0.5, beating=("p0", "d0", "d1"))
    assert shutdowns(out) == [victim]
    assert shutdowns(h.advance(1.0, beating=("p0", "d0", "d1"))) == []  # once
    h.worker(victim, MsgType.BYE, worker_id=victim)
    assert h.m.status()["roles"] == {"prefill": 1, "decode": 1}


def test_a_draining_prefill_worker_is_kept_while_its_kv_waits_for_a_decode_worker():
    h = Harness(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    pre = only(h.submit(make_admitted("a")), MsgType.PREFILL)
    holder = pre.worker_id
    drain(h, holder)
    h.worker("d0", MsgType.BYE, worker_id="d0")  # the decode pool empties meanwhile
    assert h.prefilled(holder, pre, 7) == []  # no decode worker: parked, its KV on the draining worker
    assert h.m.status()["waiting"] == {"decode": {"requests": 1, "oldest_s": 0.0}}
    assert shutdowns(h.advance(1.0, beating=("p0", "p1"))) == []
    out = h.join("d1", "decode")
    only(out, MsgType.DECODE, "d1")
    assert shutdowns(h.advance(0.5, beating=("p0", "p1", "d1"))) == [holder]  # the decode worker fetches it now


def test_image_requests_wait_parked_for_an_encoder_and_are_counted_for_the_autoscaler():
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    h.t = 10.0
    assert h.submit(make_admitted("img", images=1)) == []  # parked: no encode worker
    only(h.submit(make_admitted("txt")), MsgType.PREFILL, "p0")  # text goes on
    h.advance(2.5, beating=("p0", "d0"))
    assert h.m.status()["waiting"] == {"encode": {"requests": 1, "oldest_s": 2.5}}
    h.advance(2.0, beating=("p0", "d0"))  # within the stage timeout (5 s here): still waiting, not failed
    assert h.m.status()["waiting"]["encode"]["requests"] == 1
    out = h.join("e0", "encode")
    only(out, MsgType.ENCODE, "e0")
    assert h.m.status()["waiting"] == {}


def test_a_request_parked_longer_than_the_stage_timeout_ends_with_no_workers():
    """The bound on a cold start from zero: the coordinator's --stage-timeout-s (docs/autoscaling.md)."""
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    h.submit(make_admitted("img", images=1))
    err = only(h.advance(5.5, beating=("p0", "d0")), MsgType.ERROR)
    assert err.body["code"] == "no_workers" and h.m.status()["waiting"] == {}


def test_the_last_worker_of_a_pool_draining_parks_new_requests_instead_of_routing_to_it():
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    drain(h, "p0")
    assert h.submit(make_admitted("a")) == []
    assert h.m.status()["waiting"] == {"prefill": {"requests": 1, "oldest_s": 0.0}}
    assert shutdowns(h.advance(0.5, beating=("p0", "d0"))) == ["p0"]  # nothing on it: released at once
    only(h.join("p1", "prefill"), MsgType.PREFILL, "p1")


def test_a_worker_that_restarts_under_the_same_id_is_not_draining():
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    drain(h, "p0")
    h.advance(0.5, beating=("p0", "d0"))
    h.join("p0", "prefill")  # a new process
    assert h.m.status()["workers"]["p0"]["draining"] is False
    only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")


# -- the worker's side ----------------------------------------------------------------------------------------

def test_worker_drain_bookkeeping():
    d = Drain(timeout_s=10)
    assert d.exit_reason(busy=False, unfetched=0, now=0) is None  # not draining: never exits on its own
    assert d.begin(now=100) and not d.begin(now=101)  # the second SIGTERM says "stop now"
    assert d.exit_reason(busy=False, unfetched=0, now=101) is None  # idle, but not released yet
    d.released = True
    assert d.exit_reason(busy=True, unfetched=0, now=102) is None
    assert d.exit_reason(busy=False, unfetched=1, now=102) is None  # KV not fetched yet
    assert d.exit_reason(busy=False, unfetched=0, now=102).startswith("drained")
    late = Drain(timeout_s=10)
    late.begin(now=0)
    assert "drain timeout (10s)" in late.exit_reason(busy=True, unfetched=0, now=10)
    lost = Drain(timeout_s=10)
    lost.begin(now=0)
    lost.link_down = True
    assert "unreachable" in lost.exit_reason(busy=True, unfetched=0, now=1)
