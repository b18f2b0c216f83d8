"""The clients' sans-IO core (coordinator/client_request.py): its decisions, with the clock passed in and no
socket anywhere."""

from __future__ import annotations

import pytest

from mserve.coordinator.client_core import Lost, RequestTimeout, ShardChooser
from mserve.coordinator.client_request import Attempts, RequestMaker
from mserve.coordinator.client_shards import SHARD_PROBES_UNANSWERED

ONE = "tcp://127.0.0.1:5555"
TWO = "tcp://127.0.0.1:5555,tcp://127.0.0.1:5556"
TEXT = [{"role": "user", "content": "hi"}]


class _Maker(RequestMaker):
    def __init__(self, address: str, media_store=None) -> None:
        self._setup(address, timeout_s=10.0, probe_after_s=1.0, api_key=None, media_store=media_store)


def test_body_deadline_and_wait() -> None:
    maker = _Maker(ONE)
    req = maker._request(TEXT, True, None, "r1", {"max_tokens": 3}, tokens_to="tcp://127.0.0.1:7000")
    assert req.body["request_id"] == "r1" and req.body["tokens_to"] == "tcp://127.0.0.1:7000" and req.asm.reorder
    assert "tokens_to" not in maker._request(TEXT, False, 2.0, "r2", {}, tokens_to="tcp://127.0.0.1:7000").body
    assert req.begin(100.0) == ONE and req.deadline == 110.0
    assert req.wait_until(100.0) == 101.0 and req.wait_until(109.5) == 110.0
    assert req.send_until(100.0) == 110.0  # one coordinator: a send waits the whole deadline
    assert isinstance(req.unsent(110.0, 110.0), RequestTimeout)


def test_media_store_gets_the_body() -> None:
    class Store:
        def store_messages(self, body):
            return {**body, "stored": True}

    assert _Maker(ONE, Store())._request(TEXT, False, None, "r", {}, None).body["stored"] is True


def test_silence_probes_then_times_out_with_one_coordinator() -> None:
    req = _Maker(ONE)._request(TEXT, False, None, "r", {}, None)
    req.begin(0.0)
    for t in range(1, 10):  # never given up on: the only coordinator there is
        assert req.silent(float(t), last_heard=0.0) is None
    with pytest.raises(RequestTimeout, match="no result within 10.0s"):
        req.silent(10.0, last_heard=0.0)


def test_silent_shard_is_given_up_unless_it_answered() -> None:
    maker = _Maker(TWO)
    req = maker._request(TEXT, False, None, "r", {}, None)
    shard = req.begin(0.0)
    for t in range(1, SHARD_PROBES_UNANSWERED + 1):
        assert req.silent(float(t), last_heard=0.0) is None  # probe
    assert req.silent(3.5, last_heard=2.5) is None  # heard from it after the last probe: counting restarts
    assert req.silent(4.0, last_heard=2.5) is None
    kind, reply = req.silent(5.0, last_heard=2.5)  # two probes in a row unanswered: Lost
    assert reply.code == "lost" and shard in reply.message
    assert maker._shards.up(5.0) == [a for a in maker._shards.addresses if a != shard]


def test_unsent_with_shards_is_lost_and_retried_once_per_shard() -> None:
    maker = _Maker(TWO)
    req = maker._request(TEXT, False, None, "r", {}, None)
    req.begin(0.0)
    until = req.send_until(0.0)
    assert until < req.deadline  # a shard gets only as long as a silent one is given
    exc = req.unsent(until, until)
    assert isinstance(exc, Lost)
    attempts = Attempts(maker._shards, "r", 10.0)
    tries = iter(attempts)
    assert next(tries) <= 10.0
    attempts.lost(exc)  # another shard may take it
    next(tries)
    with pytest.raises(Lost):
        attempts.lost(exc)  # the last shard's loss is raised


def test_lost_is_raised_at_once_with_one_coordinator() -> None:
    attempts = Attempts(ShardChooser(ONE), "r", 10.0)
    next(iter(attempts))
    with pytest.raises(Lost):
        attempts.lost(Lost("gone", request_id="r"))
