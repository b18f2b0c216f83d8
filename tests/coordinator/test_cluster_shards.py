"""Sharded coordinators (docs/scaling.md) as real processes: shards announce themselves in Redis, workers
connect to every shard they find there, clients spread requests by request id, a shard that joins
later is served by the same pools, and a shard that dies loses none of its requests: its clients
send them to another shard and the workers cancel what it left behind. The shards run the
many-shard option --token-report-every (tokens straight from the decode worker to the clients).
Tokens equal HF generate's."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from mserve.common.protocol import MsgType
from mserve.common.redis_store import RedisStore
from mserve.common.shards import ShardRegistry, client_addresses_from_redis, pick_shard
from mserve.common.sockets import bound_address, free_port, make_socket, recv, send
from mserve.coordinator.client import Client
from mserve.coordinator.client_core import RequestTimeout, generate_body
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected
from tests.coordinator.test_cluster_direct_tokens import EVERY, check_direct_tokens
from tests.helpers import chat, make_image, request_mix, wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


def generate_each(address: str, requests, ids, max_tokens: int = MAX_TOKENS, **kw):
    """One sync Client per request, all at once (each picks its shard by request id)."""
    def one(req, rid):
        with Client(address, timeout_s=120, probe_after_s=0.5) as c:
            return c.generate(chat(*req), request_id=rid, max_tokens=max_tokens, **kw)
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests, ids))


def shard_status(address: str) -> dict:
    with Client(address, timeout_s=10) as c:
        return c.status()


@pytest.fixture(scope="module")
def sharded(tiny_model_dirs):
    """Two coordinator shards over one encode, prefill and decode worker, with the cluster's own Redis."""
    with LocalCluster(str(tiny_model_dirs["llava"]), encode=1, prefill=1, decode=1, coordinators=2,
                      extra_coordinator_args=["--token-report-every", str(EVERY)]) as c:
        yield c


def test_requests_spread_over_the_shards_match_hf(sharded, tiny_model_dirs):
    store = RedisStore(sharded.redis_url)
    try:
        live = ShardRegistry(store).live()
    finally:
        store.close()
    assert sorted(live) == ["shard-0", "shard-1"]
    assert [live[s]["client"] for s in sorted(live)] == sharded.shard_addresses
    assert client_addresses_from_redis(sharded.redis_url) == sharded.shard_addresses

    requests = request_mix(10, seed=21)
    # Ids that hash to each shard in turn: the shards' ports are random, and ten ids left to chance landed
    # all on one shard about once in 500 runs (the spread of the hashing itself: tests/coordinator/test_client_shards.py).
    shards = sharded.shard_addresses
    ids = [next(rid for k in itertools.count() if pick_shard(rid := f"spread-{i}-{k}", shards) == shards[i % 2])
           for i in range(len(requests))]
    results = generate_each(sharded.address, requests, ids)
    assert [r.token_ids for r in results] == expected(str(tiny_model_dirs["llava"]), requests)
    # Each request was admitted by the shard its id hashes to, and by no other.
    admitted = [shard_status(a)["stats"]["admitted"] for a in sharded.shard_addresses]
    owners = [pick_shard(rid, sharded.shard_addresses) for rid in ids]
    assert admitted == [owners.count(a) for a in sharded.shard_addresses]
    assert admitted == [5, 5]
    # Both shards see the same pools (every worker connected to both).
    for address in sharded.shard_addresses:
        workers = shard_status(address)["workers"]
        assert sorted(w for w, info in workers.items() if info["alive"]) == sorted(sharded.worker_names())


def test_one_image_requested_on_both_shards_is_encoded_once(sharded, tiny_model_dirs):
    """Single-flight encodes across shards: the shard that takes the image's lease in Redis encodes it;
    the other parks its requests on that lease, then reads the image back from the encoder holding it."""
    shards, encoder = sharded.shard_addresses, sharded.worker_names("encode")[0]
    ids = [[r for r in (f"one-image-{i}" for i in range(64)) if pick_shard(r, shards) == a][:3] for a in shards]
    requests = [("What do you see?", [make_image(44, 36, seed=1603)])] * 6
    store = RedisStore(sharded.redis_url)
    before = store.get_counters(encoder).get("encoded_images", 0)
    dedup = sum(shard_status(a)["stats"]["encode_deduplicated"] for a in shards)
    sharded.kill_worker(encoder, signal.SIGSTOP)  # the whole burst is in before the encode can end
    with ThreadPoolExecutor(1) as pool:
        replies = pool.submit(generate_each, sharded.address, requests, ids[0] + ids[1])

        def one_encode_out() -> bool:
            status = [shard_status(a) for a in shards]
            sent = [s["workers"][encoder]["load"]["inflight"] for s in status]
            return sorted(sent) == [0, 1] and sum(s["encode_parked"] for s in status) == 5
        try:
            wait_for(one_encode_out, 30, "one shard's ENCODE out, the other five requests parked")
        finally:
            sharded.kill_worker(encoder, signal.SIGCONT)
        results = replies.result(timeout=120)
    assert store.get_counters(encoder)["encoded_images"] - before == 1
    store.close()
    assert sum(shard_status(a)["stats"]["encode_deduplicated"] for a in shards) - dedup == 5
    assert [r.token_ids for r in results] == expected(str(tiny_model_dirs["llava"]), requests[:1]) * 6


def test_tokens_reach_clients_from_the_decode_worker_whichever_shard_runs_them(sharded, tiny_model_dirs):
    """--token-report-every: one token sink per client gets tokens of requests on both shards."""
    check_direct_tokens(str(tiny_model_dirs["llava"]), sharded.address, sharded.shard_addresses,
                        sharded.worker_names("decode")[0])


def test_the_decode_workers_pushes_alone_carry_a_whole_stream_from_its_first_token(sharded, tiny_model_dirs):
    """The sink gets every token from the decode worker, the prefill worker's first included (pushed as
    the DECODE is admitted, before its first step): a client's stream need not wait for the coordinator's
    relay of that token, which under load came after all the others (the whole stream at once, at the end)."""
    model = str(tiny_model_dirs["llava"])
    requests = request_mix(1, seed=41)
    ctx = zmq.Context()
    sink = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:0")
    dealer = make_socket(ctx, zmq.DEALER, connect=sharded.shard_addresses[0])
    try:
        body = generate_body("sink-only-1", chat(*requests[0]), True, max_tokens=MAX_TOKENS, ignore_eos=True)
        body["tokens_to"] = bound_address(sink)
        send(dealer, MsgType.GENERATE, body)
        result = None
        while result is None:  # the coordinator's replies: its TOKENS (every EVERY-th), then RESULT
            assert dealer.poll(120_000), "no RESULT within 120 s"
            _, kind, reply = recv(dealer)
            assert kind != MsgType.ERROR, reply
            if kind == MsgType.RESULT:
                result, prompt_tokens = reply["token_ids"], reply["prompt_tokens"]
        pushed: list[tuple[int, list[int]]] = []  # (index, tokens) in the order the sink got them
        while sum(len(t) for _, t in pushed) < MAX_TOKENS:  # they may still be on their way after RESULT
            assert sink.poll(30_000), f"the sink got only {pushed}"
            _, kind, reply = recv(sink)
            assert kind == MsgType.TOKENS and reply["request_id"] == "sink-only-1"
            pushed.append((reply["index"], reply["token_ids"]))
            if reply["index"] == 0:  # usage, for a client that stops early, as the coordinator's would say
                assert reply["prompt_tokens"] == prompt_tokens and reply["model"] is not None
    finally:
        dealer.close(linger=0)
        sink.close(linger=0)
        ctx.term()
    assert pushed[0][0] == 0 and len(pushed[0][1]) == 1  # the prefill worker's token, first
    assert [i for i, _ in pushed] == list(range(MAX_TOKENS))  # then a step at a time, in order
    assert [t for _, ts in pushed for t in ts] == result == expected(model, requests, MAX_TOKENS, ignore_eos=True)[0]


def test_a_shard_that_joins_later_is_found_by_the_workers(sharded, tiny_model_dirs):
    client_port, worker_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{client_port}"
    log = open(f"{sharded.log_dir}/coordinator-late.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mserve.cli", "coordinator", "--model", sharded.model,
                             "--bind", address, "--worker-bind", f"tcp://127.0.0.1:{worker_port}",
                             "--redis", sharded.redis_url, "--shard-id", "shard-late"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def joined() -> bool:
            try:  # the new process answers once its model's processor is loaded (seconds, on a busy box)
                return {w for w, i in shard_status(address)["workers"].items() if i["alive"]} >= set(
                    sharded.worker_names())
            except RequestTimeout:
                return False
        wait_for(joined, 60, "the workers to join the new shard")
        requests = request_mix(3, seed=22)
        results = generate_each(address, requests, [f"late-{i}" for i in range(3)])
        assert [r.token_ids for r in results] == expected(str(tiny_model_dirs["llava"]), requests)
        assert shard_status(address)["stats"]["admitted"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    # A clean stop leaves the registry at once.
    assert client_addresses_from_redis(sharded.redis_url) == sharded.shard_addresses


def test_a_dead_shards_requests_finish_on_another_shard(sharded, tiny_model_dirs):
    """SIGKILL shard 1 while it runs long requests: each ends once, with HF's tokens, via shard 0."""
    a0, a1 = sharded.shard_addresses
    ids = [rid for rid in (f"doomed-{i}" for i in range(200)) if pick_shard(rid, [a0, a1]) == a1][:4]
    requests = request_mix(4, seed=23)
    max_tokens = 160
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate_each, sharded.address, requests, ids, max_tokens, ignore_eos=True)
        wait_for(lambda: running.done() or shard_status(a1)["requests_in_flight"] >= 1, 60,
                 "shard 1 to hold a request")
        assert not running.done(), "the requests finished before the shard could be killed"
        sharded.kill_worker("coordinator-1")
        results = running.result(timeout=180)
    assert [r.token_ids for r in results] == expected(str(tiny_model_dirs["llava"]), requests, max_tokens,
                                                      ignore_eos=True)
    status = shard_status(a0)
    assert status["stats"]["admitted"] >= 1  # the re-sent ones (and, before, the spread test's)
    # The workers dropped the dead shard's link and cancelled what it had left there.
    for name in sharded.worker_names():
        wait_for(lambda: "left the registry" in sharded.log_tail(name, 400), 30, f"{name} to drop shard 1")
    decode = sharded.worker_names("decode")[0]
    wait_for(lambda: shard_status(a0)["workers"][decode]["load"]["running"] == 0, 30, "decode to be idle")
    # Its entry expired: clients reading the registry send everything to the live shard.
    wait_for(lambda: client_addresses_from_redis(sharded.redis_url) == [a0], 10, "shard 1 to leave the registry")
    later = request_mix(2, seed=24)
    results = generate_each(sharded.redis_url, later, ids[:2])
    assert [r.token_ids for r in results] == expected(str(tiny_model_dirs["llava"]), later)
