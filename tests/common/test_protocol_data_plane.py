"""The data plane's typed messages: one parse on arrival, bad requests answered with the field named."""

from __future__ import annotations

import pytest
import torch
import zmq

from mserve.common.protocol import ProtocolError
from mserve.common.protocol.data_plane import (TO_RECEIVER, TO_SENDER, Ack, DataMsg, FetchFailed, FetchRequest,
                                               TensorData, TorchReady, parse_data)
from mserve.common.sockets import make_socket, recv, send
from mserve.common.transfer import TransferEngine


@pytest.mark.parametrize("msg", [
    FetchRequest(id="t1", mode="tcp", rq=3), FetchRequest(id="t1", mode="torch", rq=4, gid="g", peer="abc"),
    Ack(id="t1"),
])
def test_sender_side_messages_round_trip(msg):
    assert parse_data(msg.KIND, msg.to_body(), TO_SENDER) == msg


@pytest.mark.parametrize("msg", [
    TensorData(t={"x": [1]}, rq=1), TorchReady(rq=2, tag=5, gid="g", store=["h", 9]), TorchReady(tag=None),
    TorchReady(stale=True), FetchFailed(error="unknown transfer id 't'", rq=7),
])
def test_receiver_side_messages_round_trip(msg):
    assert parse_data(msg.KIND, msg.to_body(), TO_RECEIVER) == msg


def test_bodies_keep_their_wire_names_and_old_bodies_still_parse():
    assert FetchRequest(id="t", mode="tcp", rq=1).to_body() == {"v": 1, "id": "t", "mode": "tcp", "rq": 1}
    assert Ack(id="t").to_body() == {"v": 1, "id": "t"}
    # Senders before the schema version reached this link sent no "v"; unknown fields are ignored.
    assert parse_data(DataMsg.ACK, {"id": "t", "later": 1}, TO_SENDER) == Ack(id="t")
    with pytest.raises(ProtocolError, match="REQUEST: missing field mode"):
        parse_data(DataMsg.REQUEST, {"id": "t"}, TO_SENDER)
    with pytest.raises(ProtocolError, match="REQUEST.rq: expected an integer"):
        parse_data(DataMsg.REQUEST, {"id": "t", "mode": "tcp", "rq": "1"}, TO_SENDER)
    with pytest.raises(ProtocolError, match="DATA is not accepted here"):
        parse_data(DataMsg.DATA, {"t": {}}, TO_SENDER)
    with pytest.raises(ProtocolError, match="unsupported schema version 2"):
        parse_data(DataMsg.ACK, {"v": 2, "id": "t"}, TO_SENDER)


def test_a_malformed_request_is_answered_naming_the_field_and_serving_goes_on():
    with TransferEngine("dp-sender") as engine:
        desc = engine.publish("t1", {"x": torch.arange(4, dtype=torch.int32)}, backend="tcp")
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, connect=engine.address)
        try:
            send(sock, DataMsg.REQUEST, {"v": 1, "id": 5, "mode": "tcp", "rq": 8})
            assert sock.poll(5000)
            _, kind, body = recv(sock)
            reply = parse_data(kind, body, TO_RECEIVER)
            assert isinstance(reply, FetchFailed) and reply.rq == 8 and "REQUEST.id: expected a string" in reply.error
            send(sock, DataMsg.REQUEST, FetchRequest(id=desc.id, mode="tcp", rq=9).to_body())
            assert sock.poll(5000)
            _, kind, body = recv(sock)
            reply = parse_data(kind, body, TO_RECEIVER)
            assert isinstance(reply, TensorData) and reply.rq == 9 and reply.t["x"].tolist() == [0, 1, 2, 3]
        finally:
            sock.close(0)
            ctx.term()
