"""Faults with real processes: kill -9 mid-stream, Redis going away, malformed frames and bad requests."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis
import zmq

from mserve.common.media_store import MediaStore
from mserve.common.protocol import ErrorCode, MsgType, body
from mserve.common.redis_server import RedisServer
from mserve.common.sockets import make_socket, recv, send
from mserve.coordinator.client import AsyncClient, BadRequest, Client
from mserve.coordinator.launcher import LocalCluster
from tests.clusters import LLAVA_1E1P1D
from tests.coordinator.test_cluster import MAX_TOKENS, expected, generate_all
from tests.helpers import chat, request_mix, wait_for

pytestmark = pytest.mark.slow
LONG = 48  # tokens per request: long enough to be mid-stream when a worker is killed


async def stream_all_and_kill(cluster: LocalCluster, requests, victim: str, after_tokens: int):
    """Stream every request; kill -9 `victim` once any request has `after_tokens` tokens."""
    killed = asyncio.Event()

    async def one(client, text, images):
        stream = client.stream(chat(text, images), max_tokens=LONG, ignore_eos=True)
        seen = []
        async for tok in stream:
            seen.append(tok)
            if len(seen) >= after_tokens and not killed.is_set():
                killed.set()
                cluster.kill_worker(victim, signal.SIGKILL)
        return seen, stream.result

    async with AsyncClient(cluster.address, timeout_s=120) as client:
        out = await asyncio.gather(*[one(client, t, ims) for t, ims in requests])
    assert killed.is_set()
    return out


@pytest.mark.parametrize("victim_role", ["decode", "prefill"])
def test_kill_9_mid_stream_every_request_completes_once(tiny_model_dirs, redis_url, victim_role):
    model = str(tiny_model_dirs["llava"])
    requests = request_mix(12, seed=3)
    want = expected(model, requests, LONG, ignore_eos=True)
    # The kill must hit requests in flight for the test to mean anything, and whether the victim still
    # holds one when the first stream has two tokens depends on the machine's load (a tiny model
    # prefills in milliseconds): every try must end each request once and exactly, until one kill hits.
    for attempt in range(3):
        if attempt:  # the killed worker's entries would read as the next cluster's (the same worker ids)
            flush = redis.Redis.from_url(redis_url)
            flush.flushall()
            flush.close()
        # Small prefill chunks keep the prefill workers busy long enough to be killed mid-work.
        with LocalCluster(model, encode=1, prefill=2, decode=2, redis_url=redis_url,
                          extra_worker_args=["--max-num-batched-tokens", "48"],
                          extra_coordinator_args=["--dead-after-s", "1.0"]) as cluster:
            victim = cluster.worker_names(victim_role)[0]
            out = asyncio.run(stream_all_and_kill(cluster, requests, victim, after_tokens=2))
        reruns = 0
        for (streamed, result), exp in zip(out, want):
            assert result is not None
            assert streamed == result.token_ids == exp  # no duplicated, missing or wrong token in the stream
            reruns += result.attempts > 1
        if reruns >= 1:  # the kill really hit requests in flight
            return
    raise AssertionError(f"in 3 tries the kill of the {victim_role} worker never hit a request in flight")


def test_redis_outage_degrades_routing_but_loses_nothing(tiny_model_dirs):
    model = str(tiny_model_dirs["qwen2_vl"])
    requests = request_mix(6, seed=11)
    with RedisServer() as redis_srv:
        with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_srv.url) as cluster:
            redis_srv.stop()
            # The requests go out once the coordinator has seen Redis go (its heartbeats fail against it).
            with Client(cluster.address, timeout_s=10) as c:
                wait_for(lambda: c.status()["redis_healthy"] is False, timeout_s=30,
                         what="the coordinator to see Redis down")
            results = asyncio.run(generate_all(cluster.address, requests))
            assert [r.token_ids for r in results] == expected(model, requests)
            assert Client(cluster.address).status()["redis_healthy"] is False


@pytest.fixture(scope="module", params=[LLAVA_1E1P1D], ids=str)
def small_cluster(request, shared_clusters):
    # Its own Redis (as every shared cluster's): the other tests here flush the session one and run
    # clusters whose workers have the same ids (encode-0, ...), whose loads in a shared Redis would read
    # as this cluster's.
    cluster = shared_clusters.get(request.param)
    yield cluster
    shared_clusters.release(request.param)


def raw_socket(address: str) -> zmq.Socket:
    return make_socket(zmq.Context.instance(), zmq.DEALER, connect=address)


def test_malformed_frames_get_error_replies_and_serving_goes_on(small_cluster):
    sock = raw_socket(small_cluster.address)
    garbage = [[b"\x01", b"\xc1not msgpack"], [b"\xff", b"\x80"], [b"", b"x"], [b"\x01"],
               [b"\x01", b"\x81\xa1v\x01", b"stray frame"], [b"\x14", b"\x80"]]
    for frames in garbage:
        sock.send_multipart(frames)
        assert sock.poll(5000), f"no reply to {frames!r}"
        _, kind, reply = recv(sock)
        assert kind == MsgType.ERROR and reply["code"] == ErrorCode.BAD_MESSAGE and reply["message"]
    sock.close(0)
    with Client(small_cluster.address) as client:
        assert client.generate(chat("Still there?"), max_tokens=4).token_ids


def test_invalid_requests_are_rejected_with_the_reason(small_cluster):
    sock = raw_socket(small_cluster.address)
    send(sock, MsgType.GENERATE, body(request_id="bad-1", messages=[{"role": "robot", "content": "hi"}]))
    assert sock.poll(5000)
    _, kind, reply = recv(sock)
    assert kind == MsgType.ERROR and reply["request_id"] == "bad-1" and reply["code"] == ErrorCode.BAD_REQUEST
    assert "role must be system, user or assistant" in reply["message"]
    sock.close(0)
    with Client(small_cluster.address) as client:
        with pytest.raises(BadRequest, match="max_tokens"):
            client.generate(chat("hi"), max_tokens=0)
        with pytest.raises(BadRequest, match="cannot read image header"):
            client.generate(chat("hi", [b"definitely not an image"]))
        assert client.generate(chat("And now a good one."), max_tokens=4).finish_reason in ("stop", "length")


def wait_alive(address: str, names: set[str], alive: bool, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with Client(address, timeout_s=5) as client:
        while True:
            try:
                status = client.status()
                if all(status["workers"].get(n, {}).get("alive", False) == alive for n in names):
                    return status
            except Exception:  # the coordinator may still be starting
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"workers {names} not alive={alive} within {timeout_s}s")
            time.sleep(0.2)


def test_stalled_worker_is_declared_dead_then_rejoins(tiny_model_dirs, redis_url):
    model = str(tiny_model_dirs["llava"])
    requests = request_mix(3, seed=21)
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_url,
                      extra_coordinator_args=["--dead-after-s", "1.0"]) as cluster:
        decode = cluster.worker_names("decode")[0]
        cluster.kill_worker(decode, signal.SIGSTOP)
        wait_alive(cluster.address, {decode}, alive=False)
        cluster.kill_worker(decode, signal.SIGCONT)
        wait_alive(cluster.address, {decode}, alive=True)
        results = asyncio.run(generate_all(cluster.address, requests))
    assert [r.token_ids for r in results] == expected(model, requests)


def test_restarted_coordinator_readmits_running_workers(tiny_model_dirs, redis_url):
    import subprocess

    model = str(tiny_model_dirs["qwen2_vl"])
    requests = request_mix(3, seed=22)
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_url) as cluster:
        names = set(cluster.worker_names())
        cluster.kill_worker("coordinator", signal.SIGKILL)
        replacement = subprocess.Popen(cluster.coordinator_command(), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_alive(cluster.address, names, alive=True, timeout_s=60)  # no worker was restarted
            results = asyncio.run(generate_all(cluster.address, requests))
        finally:
            replacement.terminate()
            replacement.wait(10)
    assert [r.token_ids for r in results] == expected(model, requests)


def test_client_abort_frees_the_request_on_its_worker(small_cluster):
    """Closing a stream early sends ABORT: the decode worker drops the request and its KV blocks."""
    decode = small_cluster.worker_names("decode")[0]
    with Client(small_cluster.address) as client, Client(small_cluster.address) as watcher:
        before = watcher.status()
        total = before["workers"][decode]["load"]["total_blocks"]
        stream = client.stream(chat("Tell me a long story.", request_mix(2, seed=5)[1][1]), max_tokens=4000,
                               ignore_eos=True)
        # Stream until the coordinator's view of the decode worker shows the request (its load comes
        # with heartbeats, 4 a second): only then does "idle again" below prove the abort freed it.
        got, deadline = [], time.monotonic() + 30
        for tok in stream:
            got.append(tok)
            busy = watcher.status()["workers"][decode]["load"]
            if len(got) >= 5 and busy["running"] == 1 and busy["free_blocks"] < total:
                break
            assert time.monotonic() < deadline, f"decode worker never reported the request: {busy}"
        stream.close()  # the client walks away mid-stream
        deadline = time.monotonic() + 10  # far sooner than 4000 tokens would take to generate
        while time.monotonic() < deadline:
            after = watcher.status()
            load = after["workers"][decode]["load"]
            if load["running"] == 0 and load["free_blocks"] == total and after["requests_in_flight"] == 0:
                break
            time.sleep(0.1)
        assert load["running"] == 0 and load["free_blocks"] == total, (busy, load)
        assert after["requests_in_flight"] == 0
        assert after["stats"]["completed"] == before["stats"]["completed"]  # it ended as aborted, not done
        assert client.generate(chat("Next one?"), max_tokens=3).token_ids  # and it keeps serving


def test_coordinator_killed_mid_stream_no_request_hangs(tiny_model_dirs, redis_url):
    """kill -9 of the coordinator mid-stream: the clients reconnect to its replacement, learn their
    requests are gone (Lost, an explicit error) instead of waiting out their timeout, the workers drop
    the orphaned requests and free their KV blocks, and new requests are served token-exact."""
    import subprocess

    from mserve.coordinator.client import Lost

    model = str(tiny_model_dirs["llava"])
    requests = request_mix(4, seed=31)
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_url) as cluster:
        names = set(cluster.worker_names())
        replacement: list[subprocess.Popen] = []

        async def run() -> list:
            started = asyncio.Event()
            counts = [0] * len(requests)

            async def one(i, client, text, images):
                try:
                    async for _ in client.stream(chat(text, images), max_tokens=2000, ignore_eos=True):
                        counts[i] += 1
                        if all(counts):
                            started.set()
                    return "completed"
                except Lost:
                    return "lost"

            async with AsyncClient(cluster.address, timeout_s=120, probe_after_s=1.0) as client:
                tasks = [asyncio.ensure_future(one(i, client, t, ims)) for i, (t, ims) in enumerate(requests)]
                await asyncio.wait_for(started.wait(), 60)
                cluster.kill_worker("coordinator", signal.SIGKILL)
                replacement.append(subprocess.Popen(cluster.coordinator_command(), stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, start_new_session=True))
                return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none hangs

        try:
            t0 = time.monotonic()
            outcomes = asyncio.run(run())
            assert outcomes.count("lost") >= 1 and set(outcomes) <= {"lost", "completed"}, outcomes
            assert time.monotonic() - t0 < 60
            status = wait_alive(cluster.address, names, alive=True, timeout_s=60)

            def kv_idle() -> bool:
                with Client(cluster.address, timeout_s=5) as c:
                    workers = c.status()["workers"]
                return all(w["counters"].get("used_blocks", 0) == 0 for w in workers.values() if w["role"] != "encode")
            deadline = time.monotonic() + 60
            while not kv_idle():  # the orphaned requests are cancelled on their workers
                assert time.monotonic() < deadline, "orphaned requests kept their KV blocks"
                time.sleep(0.2)
            fresh = request_mix(3, seed=32)
            results = asyncio.run(generate_all(cluster.address, fresh))
            assert [r.token_ids for r in results] == expected(model, fresh)
            del status
        finally:
            for proc in replacement:
                proc.terminate()
                proc.wait(10)


async def flush_while_in_flight(cluster: LocalCluster, redis_url: str, requests, media: MediaStore) -> list:
    """Send `requests` (each with images, from `media`) to a frozen encoder (SIGSTOP, so they are surely
    accepted and waiting, their refs not yet pulled), FLUSHALL Redis, thaw the encoder; every outcome."""
    encode = cluster.worker_names("encode")[0]
    async with AsyncClient(cluster.address, timeout_s=60, media_store=media) as client:
        cluster.kill_worker(encode, signal.SIGSTOP)
        try:
            tasks = [asyncio.ensure_future(client.generate(chat(t, ims), max_tokens=MAX_TOKENS))
                     for t, ims in requests]
            deadline = time.monotonic() + 3  # well inside --dead-after-s (5 s)
            while True:
                status = await client.status()
                if status["requests_in_flight"] == len(requests) and status["workers"][encode]["load"]["inflight"]:
                    break
                assert time.monotonic() < deadline, "the requests never reached the frozen encoder"
                await asyncio.sleep(0.01)
            flush = redis.Redis.from_url(redis_url)
            flush.flushall()
            flush.close()
        finally:
            cluster.kill_worker(encode, signal.SIGCONT)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)  # none hangs


@pytest.mark.parametrize("how", ["flushall", "restart"])
def test_redis_losing_its_state_is_rebuilt_by_the_workers(tiny_model_dirs, how):
    """FLUSHALL, or a restart without persistence: every registration, load and index entry is gone.
    The workers notice at their next heartbeat, register again and republish their embedding and
    prefix indexes; requests never stop being served, token-exact. The images go through a media store;
    FLUSHALL lands while requests with refs not yet pulled wait on the encoder, and each ends once, exact."""
    from mserve.common.hashing import host_member
    from mserve.common.images import image_hash
    from mserve.common.redis_store import RedisStore
    from mserve.common.transfer.backends import host_id

    model = str(tiny_model_dirs["llava"])
    requests = request_mix(3, seed=41)  # text, one image, two images
    in_flight = [r for r in request_mix(6, seed=42) if r[1]]  # images the encoder has not seen
    image = requests[1][1][0]
    from mserve.common.redis_server import free_port

    with RedisServer(port=free_port()) as redis_srv, MediaStore() as media:  # a fixed port: the restart comes back on it
        # Prefix skips off: the repeated requests must reach the encoder, to show the republished embedding index.
        with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_srv.url,
                          extra_coordinator_args=["--prefix-skip", "off"]) as cluster:
            first = asyncio.run(generate_all(cluster.address, requests, media_store=media))
            store = RedisStore(redis_srv.url)
            encode = cluster.worker_names("encode")[0]
            holders = {encode, host_member(host_id())}  # the encoder (L1) and its host's shared cache (L2)
            assert store.lookup_embedding(model, image_hash(image)) == holders
            flushed: list = []
            if how == "flushall":
                flushed = asyncio.run(flush_while_in_flight(cluster, redis_srv.url, in_flight, media))
            else:
                redis_srv.stop()
                redis_srv.start()

            def rebuilt() -> bool:
                census = store.census() or {}
                return (set(store.list_workers()) == set(cluster.worker_names())
                        and store.lookup_embedding(model, image_hash(image)) == holders
                        and census.get("prefix", {}).get(model, 0) > 0)
            deadline = time.monotonic() + 30
            while not rebuilt():
                assert time.monotonic() < deadline, "redis state was not rebuilt by the workers"
                time.sleep(0.1)
            again = asyncio.run(generate_all(cluster.address, requests, media_store=media))
            # The coordinator's store turns healthy at its next successful Redis call (a probe, or a
            # lookup): wait for it rather than race it.
            deadline = time.monotonic() + 30
            while Client(cluster.address).status()["redis_healthy"] is not True:
                assert time.monotonic() < deadline, "the coordinator never saw Redis healthy again"
                time.sleep(0.1)
            status = Client(cluster.address).status()
            store.close()
    want = expected(model, requests)
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == want
    assert again[1].cache_hits["embedding"] == 1  # the republished index routed it to the cached copy
    if how == "flushall":
        assert [r.token_ids for r in flushed] == expected(model, in_flight)  # each ended once, exactly
    assert status["requests_in_flight"] == 0 and status["stats"]["media_bytes_inline"] == 0


def test_kill_9_of_an_encode_worker_holding_work_reruns_it_elsewhere(tiny_model_dirs, redis_url):
    """The encoder is frozen (SIGSTOP) so it surely holds dispatched images, then killed: the coordinator
    declares it dead and runs those encodes on the other encoder; every request ends once, token-exact.
    The images are in the client's media store (common/media_store.py): the other encoder pulls them again."""
    model = str(tiny_model_dirs["qwen2_vl"])
    requests = [r for r in request_mix(9, seed=51) if r[1]]  # the ones with images
    with LocalCluster(model, encode=2, prefill=1, decode=1, redis_url=redis_url,
                      extra_coordinator_args=["--dead-after-s", "1.0"]) as cluster:
        victim = cluster.worker_names("encode")[0]

        async def run():
            async with AsyncClient(cluster.address, timeout_s=120, media_store=media) as client:
                cluster.kill_worker(victim, signal.SIGSTOP)
                tasks = [asyncio.ensure_future(client.generate(chat(t, ims), max_tokens=12)) for t, ims in requests]
                deadline = time.monotonic() + 10
                while (await client.status())["workers"][victim]["load"]["inflight"] == 0:
                    assert time.monotonic() < deadline, "no image was routed to the frozen encoder"
                    await asyncio.sleep(0.01)
                cluster.kill_worker(victim, signal.SIGKILL)
                return await asyncio.gather(*tasks)

        with MediaStore() as media:
            results = asyncio.run(run())
            pulled = media.stats()["served"]
        status = Client(cluster.address).status()
    assert [r.token_ids for r in results] == expected(model, requests)
    assert any(r.attempts > 1 for r in results)  # the killed encoder really held work
    assert status["stats"]["media_bytes_inline"] == 0 and pulled >= len({im for _, ims in requests for im in ims})
