"""A worker's links to coordinator shards (workers/links.py) against real ROUTER sockets and a real Redis:
replies go to the shard a request came from (its record on the worker keeps the link), a decode step's
tokens are split per shard, shards announced in Redis are joined, and one that leaves the registry is
dropped, its link handed back for the worker to cancel the requests that came from it."""

from __future__ import annotations

import time

import pytest
import zmq

from mserve.common.protocol import MsgType
from mserve.common.protocol.to_coordinator import Bye, Failed, StepTokens, TokenItem
from mserve.common.redis_store import RedisStore
from mserve.common.shards import ShardRegistry
from mserve.common.sockets import make_socket, recv, send
from mserve.workers.links import CoordinatorLinks
from mserve.workers.requests import WorkerRequests
from tests.helpers import wait_for


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def router(ctx) -> tuple[zmq.Socket, str]:
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def heard(sock: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, dict]:
    assert sock.poll(timeout_ms), "nothing arrived"
    return recv(sock)


def deliver(links: CoordinatorLinks, requests: WorkerRequests, sock: zmq.Socket, kind: MsgType, body: dict) -> None:
    """The shard behind `sock` sends `body` to the worker, which reads it through its links and, as the
    worker does for a stage message, makes the request's record on the link it came in on."""
    send(sock, kind, body, identity=b"w0")
    (link,) = wait_for(lambda: links.poll(50), what="the message at the worker")
    got_kind, got = links.recv(link)
    if got_kind != MsgType.CANCEL:
        requests.arrive(got["request_id"], got["attempt"], origin=link.address)


def origins(requests: WorkerRequests) -> dict[str, str | None]:
    return {rec.request_id: rec.origin for rec in requests}


def connected(links: CoordinatorLinks) -> None:
    """Sends wait for a connection (IMMEDIATE): wait until every link has one."""
    wait_for(lambda: all(link.sock.poll(0, zmq.POLLOUT) for link in links.links.values()), what="connections")


def step(*rids: str) -> StepTokens:
    return StepTokens(items=[TokenItem(request_id=r, attempt=1, token_ids=[7]) for r in rids])


def test_replies_go_to_the_shard_the_request_came_from(ctx):
    (a, addr_a), (b, addr_b) = router(ctx), router(ctx)
    requests = WorkerRequests()
    links = CoordinatorLinks(ctx, "w0", [addr_a, addr_b], origin_of=requests.origin_of)
    try:
        connected(links)
        assert links.send(Bye(worker_id="w0"), MsgType.BYE)
        for sock in (a, b):  # a message of no request (registration, heartbeat, goodbye) reaches every shard
            assert heard(sock)[1] == MsgType.BYE
        deliver(links, requests, a, MsgType.DECODE, {"request_id": "ra", "attempt": 1})
        deliver(links, requests, b, MsgType.DECODE, {"request_id": "rb", "attempt": 1})
        assert origins(requests) == {"ra": addr_a, "rb": addr_b}

        links.send(Failed(request_id="rb", attempt=1, message="x", retryable=True), MsgType.FAILED)
        _, kind, body = heard(b)
        assert (kind, body["request_id"]) == (MsgType.FAILED, "rb")
        assert not a.poll(200), "shard a got shard b's reply"

        links.send(step("ra", "rb"), MsgType.STEP_TOKENS)  # one decode step holding both shards' requests
        assert [i["request_id"] for i in heard(a)[2]["items"]] == ["ra"]
        assert [i["request_id"] for i in heard(b)[2]["items"]] == ["rb"]

        # A late CANCEL from a shard does not take over a request re-sent elsewhere.
        deliver(links, requests, a, MsgType.CANCEL, {"request_id": "rb"})
        assert requests.origin_of("rb") == addr_b
    finally:
        links.close()
        a.close(0)
        b.close(0)


def test_a_draining_worker_is_released_only_by_every_shard(ctx):
    (a, addr_a), (b, addr_b) = router(ctx), router(ctx)
    links = CoordinatorLinks(ctx, "w0", [addr_a, addr_b])
    try:
        assert links.release(links.links[addr_a]) is False
        assert links.release(links.links[addr_b]) is True
    finally:
        links.close()
        a.close(0)
        b.close(0)


def test_shards_announced_in_redis_are_joined_and_dropped(ctx, redis_url):
    store = RedisStore(redis_url)
    registry = ShardRegistry(store)
    (a, addr_a), (b, addr_b) = router(ctx), router(ctx)
    requests = WorkerRequests()
    links = CoordinatorLinks(ctx, "w0", [addr_a], registry=registry, grace_s=0.3, origin_of=requests.origin_of)
    try:
        registry.announce("s1", "tcp://127.0.0.1:1", addr_b, started=time.time())
        opened, closed = links.refresh()
        assert [link.address for link in opened] == [addr_b] and links.links[addr_b].shard_id == "s1"
        assert closed == []
        connected(links)
        links.send_to(addr_b, step(), MsgType.STEP_TOKENS)
        heard(b)
        deliver(links, requests, b, MsgType.DECODE, {"request_id": "r1", "attempt": 1})
        deliver(links, requests, a, MsgType.DECODE, {"request_id": "r0", "attempt": 1})

        registry.withdraw("s1")
        assert links.refresh() == ([], [])  # gone from one read is not gone: a Redis restart looks the same
        assert addr_b in links.links
        _, closed = wait_for(lambda: (r := links.refresh())[1] and r, what="the shard to be dropped")
        assert [link.address for link in closed] == [addr_b] and list(links.links) == [addr_a]  # the named shard stays
        assert requests.from_origin(addr_b) == ["r1"]  # what the worker cancels
        assert origins(requests) == {"r1": addr_b, "r0": addr_a}
        # Its replies are dropped, not sent to another shard.
        assert links.send(Failed(request_id="r1", attempt=1, message="x", retryable=True), MsgType.FAILED)
        assert not a.poll(200)
    finally:
        links.close()
        store.close()
        a.close(0)
        b.close(0)
