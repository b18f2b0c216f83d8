"""The client link's typed messages: same msgpack maps as before, checked field by field in one parse."""

from __future__ import annotations

import msgpack
import pytest

from mserve.common.protocol import MsgType, ProtocolError, body, check_header, parse_message
from mserve.common.protocol.client import (FROM_CLIENT, TO_CLIENT, Abort, Error, Generate, Result, Sampling, Status,
                                           StatusReply, Tokens)
from mserve.common.protocol.to_worker import PrefillTask
from mserve.common.serde import SCHEMA_VERSION, decode, encode
from mserve.workers.sequence import SamplingParams

MESSAGES = [
    Generate(request_id="r1", messages=[{"role": "user", "content": "hi"}],
             sampling=Sampling(max_tokens=5, temperature=0.5, seed=3, stop_token_ids=[7, 8]), priority=2,
             latency_class="batch", stream=True, tokens_to="tcp://10.0.0.1:4000"),
    Abort(request_id="r1"),
    Status(),
    Status(request_ids=["a", "b"]),
    Tokens(request_id="r1", index=0, token_ids=[1, 2], prompt_tokens=9),
    Result(request_id="r1", token_ids=[1, 2, 3], text="abc", finish_reason="length", timings={"total_s": 0.5},
           prompt_tokens=9, visual_tokens=4, cache_hits={"embedding": 1}, attempts=2),
    Error(request_id="r1", code="overloaded", message="full", retry_after_s=2.5),
    Error(request_id=None, code="bad_message", message="did not decode"),
    StatusReply(workers={"w1": {"role": "decode"}}, report={"model": "m", "shard_id": None, "stats": {"completed": 3}}),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_client_message_round_trips_through_the_wire(msg):
    accepted = FROM_CLIENT if msg.KIND in FROM_CLIENT else TO_CLIENT
    kind, payload = decode(encode(msg.KIND, msg.to_body()))
    assert payload["v"] == SCHEMA_VERSION
    assert parse_message(kind, payload, accepted) == msg


def test_bodies_are_the_maps_the_wire_always_carried():
    """Old and new processes talk: field names and values as the hand-built dicts had them."""
    assert Tokens(request_id="r", index=3, token_ids=[4]).to_body() == body(request_id="r", index=3, token_ids=[4])
    assert Error(request_id=None, code="x", message="m").to_body() == body(request_id=None, code="x", message="m")
    assert Status(request_ids=["r"]).to_body() == body(request_ids=["r"]) and Status().to_body() == body()
    reply = StatusReply(workers={}, report={"model": "m", "redis_healthy": False}).to_body()
    assert reply == body(workers={}, model="m", redis_healthy=False)
    sampling = {"max_tokens": 5, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 3, "stop_token_ids": [],
                "ignore_eos": False}
    generate = Generate(request_id="r", messages=[], sampling=Sampling(max_tokens=5, seed=3)).to_body()
    assert generate == body(request_id="r", messages=[], sampling=sampling, priority=0, latency_class="interactive",
                            stream=False)
    assert msgpack.unpackb(msgpack.packb(generate)) == generate


@pytest.mark.parametrize("kind, payload, words", [
    (MsgType.ABORT, body(), "ABORT: missing field(s) request_id"),
    (MsgType.GENERATE, body(request_id="r"), "GENERATE: missing field(s) messages"),
    (MsgType.TOKENS, body(request_id="r", token_ids=[1]), "TOKENS: missing field(s) index"),
    (MsgType.RESULT, body(request_id="r", token_ids=[], text="", finish_reason="stop"), "missing field(s) timings"),
    (MsgType.ERROR, body(code="x", message="m"), "ERROR: missing field(s) request_id"),
    (MsgType.STATUS_REPLY, body(), "STATUS_REPLY: missing field(s) workers"),
])
def test_a_missing_field_is_named(kind, payload, words):
    accepted = FROM_CLIENT if kind in FROM_CLIENT else TO_CLIENT
    with pytest.raises(ProtocolError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_message(kind, payload, accepted)


@pytest.mark.parametrize("kind, payload, words", [
    (MsgType.ABORT, body(request_id=5), "ABORT.request_id: expected a string, got int"),
    (MsgType.TOKENS, body(request_id="r", index="0", token_ids=[1]), "TOKENS.index: expected an integer"),
    (MsgType.TOKENS, body(request_id="r", index=0, token_ids=[1, "x"]), r"TOKENS.token_ids\[1\]: expected an integer"),
    (MsgType.STATUS, body(request_ids="r"), "STATUS.request_ids: expected a list"),
    (MsgType.GENERATE, body(request_id="r", messages=[], sampling={"top_p": "high"}),
     "GENERATE.sampling.top_p: expected a number"),
    (MsgType.GENERATE, body(request_id="r", messages=[], latency_class="urgent"),
     "GENERATE.latency_class: expected one of interactive, batch"),
    (MsgType.ERROR, body(request_id=None, code="x", message="m", retry_after_s="soon"),
     "ERROR.retry_after_s: expected a number"),
])
def test_a_wrong_type_is_named(kind, payload, words):
    accepted = FROM_CLIENT if kind in FROM_CLIENT else TO_CLIENT
    with pytest.raises(ProtocolError, match=words):
        parse_message(kind, payload, accepted)


def test_unknown_fields_are_ignored_and_reports_keep_theirs():
    assert parse_message(MsgType.ABORT, body(request_id="r", from_the_future=[1]), FROM_CLIENT) == Abort("r")
    tokens = parse_message(MsgType.TOKENS, body(request_id="r", index=0, token_ids=[1], novel=True), TO_CLIENT)
    assert tokens == Tokens(request_id="r", index=0, token_ids=[1])
    sampling = body(request_id="r", messages=[], sampling={"max_tokens": 3, "min_p": 0.1})
    assert parse_message(MsgType.GENERATE, sampling, FROM_CLIENT).sampling == Sampling(max_tokens=3)
    # STATUS_REPLY is a report: what the coordinator adds reaches the caller of status() as it came.
    reply = parse_message(MsgType.STATUS_REPLY, body(workers={}, queued={"prefill": 2}), TO_CLIENT)
    assert reply.as_dict() == {"workers": {}, "queued": {"prefill": 2}}


def test_the_endpoint_and_the_schema_version_are_checked_first():
    with pytest.raises(ProtocolError, match="RESULT is not accepted here"):
        parse_message(MsgType.RESULT, body(), FROM_CLIENT)
    with pytest.raises(ProtocolError, match="unknown message type 99"):
        parse_message(99, body(), FROM_CLIENT)
    with pytest.raises(ProtocolError, match="unsupported schema version 99"):
        check_header(MsgType.ABORT, {"v": 99, "request_id": "r"}, FROM_CLIENT)
    with pytest.raises(ProtocolError, match="ABORT body must be a map"):
        check_header(MsgType.ABORT, [1], FROM_CLIENT)


def test_sampling_has_one_wire_shape_from_client_to_engine():
    """GENERATE's sampling is PREFILL's, and the engine's SamplingParams is made from it once."""
    wire = Sampling(max_tokens=7, temperature=0.8, top_k=5, top_p=0.9, seed=11, stop_token_ids=[2], ignore_eos=True)
    generate = Generate.from_body(Generate(request_id="r", messages=[], sampling=wire).to_body())
    task = PrefillTask.from_body(PrefillTask(request_id="c1", attempt=0, prompt_ids=[1], sampling=generate.sampling)
                                 .to_body())
    assert task.sampling == wire
    params = SamplingParams.from_wire(task.sampling)
    assert params == SamplingParams(max_tokens=7, temperature=0.8, top_k=5, top_p=0.9, seed=11, stop_token_ids=(2,),
                                    ignore_eos=True)
    assert params.to_wire() == wire


def test_the_prefill_to_decode_state_is_typed_end_to_end():
    """PREFILLED carries the engine's KVState to the coordinator, DECODE carries it on unchanged."""
    from mserve.common.protocol.to_coordinator import Prefilled
    from mserve.common.protocol.to_worker import DecodeTask, KVState

    state = KVState(request_id="p-1", prompt_ids=[1, 2, 3], output_ids=[9], num_computed_tokens=3, block_size=16,
                    images=[[1, 4, "h"]], sampling=Sampling(max_tokens=4, seed=5), rope_delta=-2, priority=1,
                    latency_class="batch")
    prefilled = Prefilled.from_body(Prefilled(request_id="c1", attempt=0, token_id=9, finish_reason="prefilled",
                                              descriptor={"d": 1}, state=state).to_body())
    assert prefilled.state == state
    decode = DecodeTask.from_body(DecodeTask(request_id="c1", attempt=0, descriptor={"d": 1},
                                             state=prefilled.state).to_body())
    assert decode.state == state
    with pytest.raises(ProtocolError, match="DECODE.state: missing field block_size"):
        DecodeTask.from_body({**decode.to_body(), "state": {k: v for k, v in state.fields().items()
                                                            if k != "block_size"}})


def test_the_api_key_is_a_field_of_every_client_message_never_in_a_repr():
    from mserve.common.protocol.client import Signed
    from mserve.common.protocol.to_worker import SwitchRole

    assert all(issubclass(cls, Signed) for cls in FROM_CLIENT.values()) and issubclass(SwitchRole, Signed)
    msg = Abort(request_id="r1", api_key="s3cret")
    wire_body = msg.to_body()
    assert Abort.from_body(wire_body) == msg and "s3cret" not in repr(msg)
    assert Signed.take_api_key(wire_body) == "s3cret" and "api_key" not in wire_body
    assert "api_key" not in Abort(request_id="r1").to_body()  # none: no field travels
    assert Signed.sign(Status().to_body(), None) == Status().to_body()
    with pytest.raises(ProtocolError, match="ABORT.api_key"):
        Abort.from_body(body(request_id="r1", api_key=7))
