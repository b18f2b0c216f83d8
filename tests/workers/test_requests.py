"""One record per request on a worker (workers/requests.py): made on arrival, replaced by a newer attempt,
ended once, and the one place a request's shard, transfer time, freshness and cached prefix are read from."""

from __future__ import annotations

from mserve.workers.requests import WorkerRequests
from mserve.workers.sequence import Sequence


def test_a_record_lives_from_arrival_to_its_one_end():
    table = WorkerRequests()
    rec = table.arrive("r1", 0)
    assert table.get("r1") is rec and table.get("r1", 0) is rec and table.get("r1", 1) is None
    assert (rec.fresh, rec.take_fetch_s(), rec.cached_tokens, rec.route) == (True, None, 0, None)
    newer = table.arrive("r1", 1)  # a re-run of the same request replaces the older attempt's record
    assert table.get("r1") is newer and len(table) == 1
    assert table.end("r1", 0) is None and "r1" in table  # an older attempt's end leaves the newer one
    assert table.end("r1") is newer and table.end("r1") is None and len(table) == 0


def test_fetch_time_is_reported_once_and_the_prefix_hit_read_from_the_sequence():
    rec = WorkerRequests().arrive("r1", 0)
    rec.add_fetch(0.25)
    rec.add_fetch(0.5)
    assert rec.take_fetch_s() == 0.75 and rec.take_fetch_s() is None
    rec.seq = Sequence(request_id="r1", prompt_ids=[1, 2, 3])
    rec.seq.num_cached_tokens = 16  # known only once the scheduler first took the prompt
    assert rec.cached_tokens == 16 and rec.worker_s() >= 0.0


def test_replies_find_the_shard_a_request_came_from_while_it_is_here():
    table = WorkerRequests()
    table.arrive("a1", 0, origin="tcp://shard-a")
    table.arrive("b1", 0, origin="tcp://shard-b")
    table.arrive("a2", 3, origin="tcp://shard-a")
    assert table.origin_of("b1") == "tcp://shard-b" and table.origin_of("zz") is None
    assert table.from_origin("tcp://shard-a") == ["a1", "a2"]  # what a shard that left leaves to cancel
    table.end("a1")
    assert table.origin_of("a1") is None and table.from_origin("tcp://shard-a") == ["a2"]
