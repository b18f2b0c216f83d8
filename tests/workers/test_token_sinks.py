"""A decode worker's pushes to a client's token sink, read by the client's own Assembler over a real
zmq PULL socket: the stream starts from the sink alone, without the coordinator's relay of the first
token (workers/token_sinks.py)."""

from __future__ import annotations

import zmq

from mserve.common.protocol import MsgType
from mserve.common.sockets import bound_address, make_socket, recv
from mserve.coordinator.client_core import Assembler
from mserve.workers.token_sinks import TokenRoute, TokenSinks


def _route(sink: str, index: int) -> TokenRoute:
    return TokenRoute(every=8, sink=sink, client_rid="c-1", index=index, prompt_tokens=12, model="m")


def _deliver(pull: zmq.Socket, asm: Assembler, n: int) -> list[list[int]]:
    """Feed the next n TOKENS from the sink to the assembler: what it hands out after each."""
    out = []
    for _ in range(n):
        assert pull.poll(10_000), "no TOKENS reached the sink"
        _, kind, body = recv(pull)
        asm.feed(kind, body)
        out.append(list(asm.ready))
        asm.ready.clear()
    return out


def test_a_decode_workers_stream_starts_without_the_coordinators_first_token():
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:0")
    sinks = TokenSinks(ctx)
    try:
        address = bound_address(pull)
        # Admitted with the prefill worker's first token (7): the next one it makes is index 1.
        route = _route(address, index=1)
        sinks.push(route, [7], index=0)  # what stepping.SteppingWorker._admit sends
        for token in (8, 9):  # two decode steps
            sinks.push(route, [token])
            route.take([token], must_report=False)
        asm = Assembler("c-1", reorder=True)
        assert _deliver(pull, asm, 3) == [[7], [8], [9]]  # a token at a time, as they were made
        assert asm.prompt_tokens == 12 and asm.model == "m"  # index 0 carries them
        assert sinks.sent == 3 and sinks.dropped == 0
    finally:
        sinks.close()
        pull.close(linger=0)
        ctx.term()


def test_without_the_first_token_the_sinks_tokens_wait_for_it():
    """Why the admission push exists: tokens past a gap are held until the gap fills."""
    asm = Assembler("c-1", reorder=True)
    for i, token in ((1, 8), (2, 9)):
        asm.feed(MsgType.TOKENS, {"request_id": "c-1", "index": i, "token_ids": [token]})
        assert not asm.ready
    asm.feed(MsgType.TOKENS, {"request_id": "c-1", "index": 0, "token_ids": [7]})  # the coordinator's, late
    assert list(asm.ready) == [7, 8, 9]  # all at once


def test_an_index_zero_push_the_client_already_has_hands_out_nothing_twice():
    asm = Assembler("c-1", reorder=True)
    asm.feed(MsgType.TOKENS, {"request_id": "c-1", "index": 0, "token_ids": [7]})  # via the coordinator
    asm.ready.clear()
    asm.feed(MsgType.TOKENS, {"request_id": "c-1", "index": 0, "token_ids": [7]})  # the worker's admission push
    asm.feed(MsgType.TOKENS, {"request_id": "c-1", "index": 1, "token_ids": [8]})
    assert list(asm.ready) == [8]
