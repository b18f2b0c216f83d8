"""Clients of sharded coordinators, no cluster: in-test ROUTERs stand in as shards. Which shard a request
goes to (rendezvous hashing of its id), ABORT to the request's own shard, a shard that stops answering
(its requests go to another one), and the address forms (comma list, redis registry)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
import zmq

from mserve.common import protocol
from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.client import StatusReply, Tokens
from mserve.common.shards import ShardRegistry, advertised, pick_shard, resolve_client_addresses, split_addresses
from mserve.common.sockets import bound_address, make_socket, recv, send
from mserve.coordinator.client import AsyncClient, Client, Lost, RequestTimeout

PROMPT = [{"role": "user", "content": "hi"}]
FLAVOURS = ["sync", "async"]


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class FakeShard:
    """A coordinator shard stand-in: a ROUTER served by a thread, recording (kind, request_id) of every message.

    mode "answer": GENERATE gets TOKENS then RESULT (text = the shard's name); "hold": one TOKENS, then
    nothing; "silent": never replies to anything; "closed": the port was bound, then closed (nothing listens).
    Probes (STATUS with request_ids) are answered "nothing unknown" unless silent.
    """

    def __init__(self, ctx: zmq.Context, name: str, mode: str = "answer") -> None:
        self.name, self.mode = name, mode
        self.router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
        self.address = bound_address(self.router)
        self.got: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        if mode == "closed":
            self.router.close(linger=0)
        else:
            self._thread.start()

    def ids(self, kind: MsgType) -> list[str | None]:
        return [rid for k, rid in list(self.got) if k == kind]

    def _reply(self, identity: bytes, kind: MsgType, **fields) -> None:
        try:
            send(self.router, kind, protocol.body(**fields), identity=identity)
        except zmq.ZMQError:  # the client is gone
            pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity, kind, body = recv(self.router)
            rid = body.get("request_id")
            self.got.append((kind, rid))
            if self.mode == "silent":
                continue
            if kind == MsgType.GENERATE:
                self._reply(identity, MsgType.TOKENS, request_id=rid, index=0, token_ids=[1, 2])
                if self.mode == "answer":
                    self._reply(identity, MsgType.RESULT, request_id=rid, token_ids=[1, 2, 3], text=self.name,
                                finish_reason="length", timings={})
            elif kind == MsgType.STATUS and "request_ids" in body:
                self._reply(identity, MsgType.STATUS_REPLY, workers={}, unknown_requests=[])
            elif kind == MsgType.STATUS:
                self._reply(identity, MsgType.STATUS_REPLY, workers={}, model=self.name)

    def close(self) -> None:
        if self.mode != "closed":
            self._stop.set()
            self._thread.join(10)
            self.router.close(linger=0)


@pytest.fixture
def shards(request):
    """shards(*modes) -> FakeShards named s0, s1, ... (closed at the end of the test)."""
    ctx = zmq.Context()
    made: list[FakeShard] = []

    def make(*modes: str) -> list[FakeShard]:
        new = [FakeShard(ctx, f"s{len(made) + i}", mode) for i, mode in enumerate(modes)]
        made.extend(new)
        return new

    yield make
    for shard in made:
        shard.close()
    ctx.term()


def addresses(*shards: FakeShard) -> str:
    return ",".join(s.address for s in shards)


def ids_for(shard: FakeShard, all_shards: list[FakeShard], n: int, prefix: str = "req") -> list[str]:
    """`n` request ids that pick_shard gives to `shard`."""
    everyone = [s.address for s in all_shards]
    out = [rid for rid in (f"{prefix}-{i}" for i in range(1000)) if pick_shard(rid, everyone) == shard.address]
    assert len(out) >= n
    return out[:n]


def run_generates(flavour: str, address: str, rids: list[str], **client_kw) -> dict[str, str]:
    """request id -> the text of its result (the name of the shard that answered), one client, in order."""
    if flavour == "sync":
        with Client(address, **client_kw) as c:
            return {rid: c.generate(PROMPT, request_id=rid, max_tokens=3).text for rid in rids}

    async def go() -> dict[str, str]:
        async with AsyncClient(address, poll_interval_s=0.01, **client_kw) as c:
            return {rid: (await c.generate(PROMPT, request_id=rid, max_tokens=3)).text for rid in rids}
    return asyncio.run(go())


# ---- which shard: rendezvous hashing (common/shards.py)


def test_pick_shard_is_deterministic_order_free_and_balanced():
    shards = [f"tcp://10.0.0.{i}:5555" for i in range(3)]
    keys = [f"r{i}" for i in range(3000)]
    picks = [pick_shard(k, shards) for k in keys]
    assert picks == [pick_shard(k, shards) for k in keys]
    assert picks == [pick_shard(k, shards[::-1]) for k in keys]  # the order they are listed in does not matter
    assert all(800 < n < 1200 for n in Counter(picks).values()) and set(picks) == set(shards)
    assert pick_shard("r1", ["tcp://only:1"]) == "tcp://only:1"
    with pytest.raises(ValueError):
        pick_shard("r1", [])


def test_adding_a_shard_moves_only_its_share_of_the_keys_and_removing_one_only_its_own():
    shards = [f"tcp://10.0.0.{i}:5555" for i in range(4)]
    keys = [f"r{i}" for i in range(4000)]
    before = {k: pick_shard(k, shards) for k in keys}
    after = {k: pick_shard(k, shards + ["tcp://10.0.0.9:5555"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "tcp://10.0.0.9:5555" for k in moved)  # only to the new shard
    assert 0.15 < len(moved) / len(keys) < 0.25  # about 1/5
    fewer = {k: pick_shard(k, shards[1:]) for k in keys}
    assert [k for k in keys if fewer[k] != before[k]] == [k for k in keys if before[k] == shards[0]]


def test_split_addresses_and_advertised():
    assert split_addresses(" tcp://a:1, tcp://b:2,,tcp://a:1 ") == ["tcp://a:1", "tcp://b:2"]
    assert split_addresses("tcp://a:1") == resolve_client_addresses("tcp://a:1") == ["tcp://a:1"]
    for blank in ("", " , "):
        with pytest.raises(ValueError):
            split_addresses(blank)
    assert advertised("tcp://10.1.2.3:5555", None, "--bind") == "tcp://10.1.2.3:5555"
    assert advertised("tcp://*:5555", "tcp://host-a:5555", "--bind") == "tcp://host-a:5555"
    for wildcard in ("tcp://*:5555", "tcp://0.0.0.0:5555"):
        with pytest.raises(ValueError, match="--advertise"):
            advertised(wildcard, None, "--bind")


def test_one_address_is_not_sharded():
    for address in ("tcp://127.0.0.1:1", "tcp://127.0.0.1:1,"):
        with Client(address) as c:
            assert not c._shards.sharded and c.address == address
        client = AsyncClient(address)
        assert not client._shards.sharded and client.address == address
        asyncio.run(client.close())


def test_a_redis_address_reads_the_registered_shards(redis_url):
    from mserve.common.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        registry = ShardRegistry(store)
        assert registry.announce("b", "tcp://127.0.0.1:2", "tcp://127.0.0.1:12", time.time())
        assert registry.announce("a", "tcp://127.0.0.1:1", "tcp://127.0.0.1:11", time.time())
        with Client(redis_url) as c:
            assert c._shards.addresses == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"] and c.address == redis_url
        client = AsyncClient(redis_url)
        assert client._shards.addresses == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        asyncio.run(client.close())
    finally:
        store.close()


# ---- requests over in-test shards


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_requests_go_to_the_shard_their_id_picks(shards, flavour):
    a, b = shards("answer", "answer")
    rids = ids_for(a, [a, b], 3) + ids_for(b, [a, b], 3)
    if flavour == "sync":
        got = run_generates("sync", addresses(a, b), rids, timeout_s=30)
    else:
        async def go() -> dict[str, str]:  # concurrently, over both shards at once
            async with AsyncClient(addresses(a, b), timeout_s=30, poll_interval_s=0.01) as c:
                results = await asyncio.gather(*(c.generate(PROMPT, request_id=rid, max_tokens=3) for rid in rids))
            return {r.request_id: r.text for r in results}
        got = asyncio.run(go())
    assert got == {rid: "s0" for rid in rids[:3]} | {rid: "s1" for rid in rids[3:]}
    assert sorted(a.ids(MsgType.GENERATE)) == sorted(rids[:3]) and sorted(b.ids(MsgType.GENERATE)) == sorted(rids[3:])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_abandoned_stream_is_aborted_on_its_own_shard(shards, flavour):
    a, b = shards("hold", "hold")
    rids = [ids_for(a, [a, b], 1)[0], ids_for(b, [a, b], 1)[0]]
    if flavour == "sync":
        with Client(addresses(a, b), timeout_s=30) as c:
            for rid in rids:
                with c.stream(PROMPT, request_id=rid) as s:
                    assert next(s) == 1
                    assert not s.done
    else:
        async def go() -> None:
            async with AsyncClient(addresses(a, b), timeout_s=30, poll_interval_s=0.01) as c:
                for rid in rids:
                    s = c.stream(PROMPT, request_id=rid)
                    assert await s.__anext__() == 1
                    assert s.shard == pick_shard(rid, [a.address, b.address])
                    await s.aclose()
                wait_until(lambda: a.ids(MsgType.ABORT) and b.ids(MsgType.ABORT))
                # AsyncClient.abort(): a pending request on its own shard, an unknown one where its id points.
                s = c.stream(PROMPT, request_id=ids_for(b, [a, b], 1, prefix="again")[0])
                assert await s.__anext__() == 1
                await c.abort(s.request_id)
                other = ids_for(a, [a, b], 1, prefix="unknown")[0]
                await c.abort(other)
                wait_until(lambda: s.request_id in b.ids(MsgType.ABORT) and other in a.ids(MsgType.ABORT))
                assert s.request_id not in a.ids(MsgType.ABORT) and other not in b.ids(MsgType.ABORT)
                s.close()
        asyncio.run(go())
    wait_until(lambda: rids[0] in a.ids(MsgType.ABORT) and rids[1] in b.ids(MsgType.ABORT))
    assert rids[1] not in a.ids(MsgType.ABORT) + a.ids(MsgType.GENERATE)
    assert rids[0] not in b.ids(MsgType.ABORT) + b.ids(MsgType.GENERATE)


@pytest.mark.parametrize("dead_mode", ["silent", "closed"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_shard_that_stopped_answering_is_left_for_another(shards, flavour, dead_mode):
    dead, live = shards(dead_mode, "answer")
    first, later = ids_for(dead, [dead, live], 2)
    t0 = time.monotonic()
    got = run_generates(flavour, addresses(dead, live), [first, later], timeout_s=60, probe_after_s=0.3)
    assert got == {first: "s1", later: "s1"}  # same ids, answered by the live shard
    assert time.monotonic() - t0 < 30, "the client waited for its timeout instead of giving up on the shard"
    assert live.ids(MsgType.GENERATE) == [first, later]
    if dead_mode == "silent":
        wait_until(lambda: dead.ids(MsgType.STATUS))  # it was probed before it was given up
        assert dead.ids(MsgType.GENERATE) == [first]  # the later request skipped it: it was taken for dead


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_lost_when_every_shard_stopped_answering(shards, flavour):
    a, b = shards("silent", "silent")
    with pytest.raises(Lost, match="stopped answering") as info:
        run_generates(flavour, addresses(a, b), ["r1"], timeout_s=60, probe_after_s=0.2)
    assert info.value.code == ErrorCode.LOST and info.value.request_id == "r1"
    wait_until(lambda: a.ids(MsgType.GENERATE) and b.ids(MsgType.GENERATE))
    assert a.ids(MsgType.GENERATE) == b.ids(MsgType.GENERATE) == ["r1"]  # tried once on each


@pytest.mark.parametrize("flavour, mode", [("async", "silent"), ("sync", "closed"), ("async", "closed")])
def test_one_coordinator_silent_or_unreachable_is_waited_for_until_the_timeout(shards, flavour, mode):
    # Unsharded: never taken for dead, never Lost without its word (sync and silent: test_client_unit.py).
    (only,) = shards(mode)
    with pytest.raises(RequestTimeout):
        run_generates(flavour, only.address, ["r1"], timeout_s=0.8, probe_after_s=0.2)
    if mode == "silent":
        wait_until(lambda: len(only.ids(MsgType.STATUS)) >= 2)  # it kept asking
        assert only.ids(MsgType.GENERATE) == ["r1"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_status_asks_a_shard_not_taken_for_dead(shards, flavour):
    a, b = shards("answer", "answer")
    if flavour == "sync":
        with Client(addresses(a, b), timeout_s=30) as c:
            assert c.status()["model"] in ("s0", "s1")
        return

    async def go() -> None:
        async with AsyncClient(addresses(a, b), timeout_s=30, poll_interval_s=0.01) as c:
            assert (await c.status())["model"] == "s0"
            c._shards.mark_down(a.address, time.monotonic())
            assert (await c.status())["model"] == "s1"
    asyncio.run(go())


def test_async_replies_count_only_from_the_requests_own_shard():
    async def go() -> None:
        c = AsyncClient("tcp://127.0.0.1:1,tcp://127.0.0.1:2")
        try:
            queue: asyncio.Queue = asyncio.Queue()
            c._pending["r"], c._routes["r"] = queue, "tcp://127.0.0.1:1"
            tokens = Tokens(request_id="r", index=0, token_ids=[7])
            c._dispatch(MsgType.TOKENS, tokens, "tcp://127.0.0.1:2")  # a late reply of an earlier attempt
            c._dispatch(MsgType.STATUS_REPLY, StatusReply(workers={}, unknown_requests=["r"]), "tcp://127.0.0.1:2")
            assert queue.empty()
            c._dispatch(MsgType.TOKENS, tokens, "tcp://127.0.0.1:1")
            assert queue.get_nowait() == (MsgType.TOKENS, tokens)
        finally:
            await c.close()
    asyncio.run(go())


@pytest.mark.parametrize("mode", ["silent", "closed"])
def test_sync_status_moves_past_a_shard_that_does_not_answer(shards, mode):
    """A health check given every shard's address stays healthy while one shard is down."""
    a, b = shards(mode, "answer")
    with Client(addresses(a, b), timeout_s=4) as c:
        assert c.status()["model"] == "s1"
        assert c._shards.up(time.monotonic()) == [b.address]  # skipped from now on


def test_a_registry_client_follows_shards_that_join(redis_url, monkeypatch):
    from mserve.common.redis_store import RedisStore
    from mserve.coordinator import client_shards

    store = RedisStore(redis_url)
    try:
        registry = ShardRegistry(store)
        registry.announce("a", "tcp://127.0.0.1:1", "tcp://127.0.0.1:11", time.time())
        chooser = client_shards.ShardChooser(redis_url)
        assert chooser.addresses == ["tcp://127.0.0.1:1"] and chooser.sharded
        registry.announce("b", "tcp://127.0.0.1:2", "tcp://127.0.0.1:12", time.time())
        assert chooser.up(time.monotonic()) == ["tcp://127.0.0.1:1"]  # not re-read before its time
        later = time.monotonic() + client_shards.SHARD_LIST_REFRESH_S
        assert chooser.up(later) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        store._r.flushall()  # nothing registered (or Redis lost): the list is kept
        assert chooser.up(later + client_shards.SHARD_LIST_REFRESH_S) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    finally:
        store.close()
