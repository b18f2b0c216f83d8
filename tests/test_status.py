"""`mserve status`: merging the coordinator's STATUS and Redis, the tables and the JSON, and a real cluster."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mserve.common.redis_store import RedisStore
from mserve.status import build_report, format_report, read_redis, redact

ROOT = Path(__file__).resolve().parent.parent
NOW = 1_000_000.0
MODEL = "models/tiny-llava"


def _load(queue=0, running=0, free=2048, total=2048, tps=0.0, inflight=0, **extra):
    return {"queue_len": queue, "running": running, "free_blocks": free, "total_blocks": total,
            "tokens_per_s": tps, "inflight": inflight, "rss_mib": 400.2, "weights_mib": 3.1, "kv_pool_mib": 512.0,
            **extra}


def coordinator_reply() -> dict:
    return {
        "workers": {
            "encode-0": {"role": "encode", "alive": True, "load": _load(queue=2, free=16, total=16)},
            "prefill-0": {"role": "prefill", "alive": True, "load": _load(running=1, free=2000, tps=10.0, inflight=1)},
            "decode-0": {"role": "decode", "alive": True, "load": _load(running=3, free=1900, tps=50.5, inflight=3),
                         "counters": {"prefix_hits": 7, "cached_blocks": 12, "steps": 99}},
            "decode-1": {"role": "decode", "alive": True, "draining": True,
                         "load": _load(running=1, free=2040, tps=20.0, inflight=1)},
            "decode-9": {"role": "decode", "alive": False, "load": _load(running=7, free=0, tps=99.0)},
        },
        "roles": {"encode": 1, "prefill": 1, "decode": 2},
        "requests_in_flight": 4,
        "stats": {"admitted": 10, "rejected": 1, "completed": 5, "failed": 0, "reruns": 2, "shed": 0},
        "model": MODEL,
        "redis_healthy": True,
        "metrics": {"something": "new"},  # a key this version does not know: ignored
    }


def redis_data() -> dict:
    reg = {w: {"role": w.split("-")[0], "data_address": "tcp://127.0.0.1:1", "pid": 1}
           for w in ("encode-0", "prefill-0", "decode-0", "decode-1")}
    loads = {w: {**_load(), "updated_at": NOW - 0.3, "at": NOW - 0.3} for w in reg}
    loads["encode-0"] = {**_load(queue=1, free=16, total=16), "updated_at": NOW - 1.25, "prefix_cache_hits": 4}
    return {"workers": reg, "loads": loads,
            "census": {"emb": {MODEL: 3, "other-model": 2}, "prefix": {MODEL: 40},
                       "counters": {"encode-0": {"encoded_images": 5, "embedding_cache_hits": 2},
                                    "encode-old": {"encoded_images": 1}}}}


def report(coord=True, redis=True) -> dict:
    return build_report("tcp://10.0.0.1:5555", coordinator_reply() if coord else None,
                        None if coord else "no STATUS reply within 3s",
                        "redis://10.0.0.2:6379/0" if redis else None, redis_data() if redis else None,
                        None if redis else "unreachable", now=NOW)


# ---- pure: merging and rendering --------------------------------------------------------------------


def test_a_coordinator_serving_two_models_shows_each_ones_pools_and_counts():
    reply = {**coordinator_reply(), "models": {
        MODEL: {"roles": {"encode": 1, "prefill": 1, "decode": 2}, "requests_in_flight": 3,
                "stats": {"completed": 4, "shed": 0}},
        "models/tiny-qwen": {"roles": {"unified": 1}, "requests_in_flight": 1, "stats": {"completed": 1, "shed": 2}}}}
    r = build_report("tcp://10.0.0.1:5555", reply, None, None, None, "unset", now=NOW)
    assert r["coordinator"]["models"]["models/tiny-qwen"] == {"roles": {"unified": 1}, "requests_in_flight": 1,
                                                              "completed": 1, "shed": 2}
    text = format_report(r)
    assert re.search(r"\n  models/tiny-qwen +1 unified +1 +1 +2\n", text), text
    assert re.search(r"\n  models/tiny-llava +1 encode 1 prefill 2 decode +3 +4 +0\n", text), text
    one = build_report("tcp://10.0.0.1:5555", {**coordinator_reply(), "models": {MODEL: {}}}, None, None, None,
                       "unset", now=NOW)
    assert "models" not in one["coordinator"]  # one model: the report is as before


def test_both_sources_merge_into_pools_workers_caches_and_stats():
    r = report()
    assert json.loads(json.dumps(r)) == r  # JSON-able as is
    assert set(r) == {"coordinator", "redis", "shards", "pools", "workers", "caches", "stats"}
    assert r["coordinator"] == {"address": "tcp://10.0.0.1:5555", "reachable": True, "error": None, "model": MODEL,
                                "redis_healthy": True, "requests_in_flight": 4}
    assert r["redis"] == {"url": "redis://10.0.0.2:6379/0", "read": True, "error": None}
    pools = {p["role"]: p for p in r["pools"]}
    assert [p["role"] for p in r["pools"]] == ["encode", "prefill", "decode"]
    # decode-9 is dead: counted in the total only, its load is not summed.
    assert pools["decode"] == {"role": "decode", "alive": 2, "total": 3, "queue_len": 0, "running": 4,
                               "kv_used": 148 + 8, "kv_total": 4096, "tokens_per_s": 70.5}
    assert pools["encode"]["queue_len"] == 2 and pools["encode"]["kv_total"] == 16
    workers = {w["id"]: w for w in r["workers"]}
    assert [w["id"] for w in r["workers"]] == ["encode-0", "prefill-0", "decode-0", "decode-1", "decode-9"]
    assert workers["decode-0"]["inflight"] == 3 and workers["decode-0"]["kv_used"] == 148
    assert workers["decode-0"]["seen_by"] == ["coordinator", "redis"]
    assert workers["decode-9"]["alive"] is False and workers["decode-9"]["seen_by"] == ["coordinator"]
    assert workers["decode-1"]["draining"] and not workers["decode-0"]["draining"]
    assert workers["decode-9"]["heartbeat_age_s"] is None
    # The coordinator's load wins (queue 2), Redis gives the heartbeat age.
    assert workers["encode-0"]["queue_len"] == 2 and workers["encode-0"]["heartbeat_age_s"] == 1.25
    assert workers["decode-0"]["heartbeat_age_s"] == 0.3
    caches = r["caches"]
    assert caches["embedding_index"] == {MODEL: 3, "other-model": 2} and caches["prefix_index"] == {MODEL: 40}
    # Counters from Redis, plus any *hit* field a worker publishes with its load.
    assert caches["worker_counters"]["encode-0"] == {"encoded_images": 5, "embedding_cache_hits": 2,
                                                     "prefix_cache_hits": 4}
    # ... and the cache figures among the per-worker counters a newer coordinator reports.
    assert caches["worker_counters"]["decode-0"] == {"prefix_hits": 7, "cached_blocks": 12}
    assert r["stats"]["completed"] == 5 and "metrics" not in json.dumps(r)


def test_table_layout():
    text = format_report(report())
    lines = text.splitlines()
    assert lines[0] == f"coordinator tcp://10.0.0.1:5555  redis healthy  requests in flight 4  model {MODEL}"
    assert lines[1] == "redis read from redis://10.0.0.2:6379/0"
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    i = lines.index("pools")
    assert lines[i + 1].split() == ["role", "alive/total", "queue", "running", "KV", "used/total", "tok/s"]
    assert lines[i + 4].split() == ["decode", "2/3", "0", "4", "156/4096", "70.5"]
    i = lines.index("workers")
    header = lines[i + 1]
    assert header.split()[:6] == ["id", "role", "alive", "queue", "running", "inflight"]
    row = lines[i + 4]
    assert row.split() == ["decode-0", "decode", "yes", "0", "3", "3", "148/2048", "50.5", "400", "0.3s", "ago"]
    # Columns line up: each value ends (numbers) or starts (names) where its header does.
    assert row.index("decode ") == header.index("role")
    assert row.index("148/2048") + len("148/2048") == header.index("KV used/total") + len("KV used/total")
    assert lines[i + 5].split()[:3] == ["decode-1", "decode", "draining"]  # SIGTERM'd: finishing, taking nothing new
    dead = lines[i + 6].split()
    assert dead[:3] == ["decode-9", "decode", "no"] and dead[-1] == "-"
    assert f"caches (model {MODEL})" in lines
    assert "  embedding index: 3 images (+2 under other model names)    prefix index: 40 blocks" in lines
    i = lines.index("  embedding index: 3 images (+2 under other model names)    prefix index: 40 blocks")
    assert lines[i + 1].split() == ["worker", "cached_blocks", "embedding_cache_hits", "encoded_images",
                                    "prefix_cache_hits", "prefix_hits"]
    assert lines[i + 2].split() == ["encode-0", "-", "2", "5", "4", "-"]
    assert lines[i + 3].split() == ["decode-0", "12", "-", "-", "-", "7"]
    assert lines[i + 4].split() == ["encode-old", "-", "-", "1", "-", "-"]
    assert lines[-1] == "  admitted 10   rejected 1   completed 5   failed 0   reruns 2   shed 0"


def test_coordinator_down_shows_what_redis_has():
    r = report(coord=False)
    assert r["coordinator"]["reachable"] is False and r["stats"] is None
    # Registered in Redis means alive (the key lives only while the worker heartbeats); load from Redis.
    assert [(w["id"], w["alive"], w["inflight"]) for w in r["workers"]] == [
        ("encode-0", True, None), ("prefill-0", True, None), ("decode-0", True, None), ("decode-1", True, None)]
    assert r["workers"][0]["queue_len"] == 1
    text = format_report(r)
    assert text.startswith("coordinator tcp://10.0.0.1:5555 UNREACHABLE: no STATUS reply within 3s\n")
    assert "Redis's registry only" in text and "(coordinator not read)" in text
    assert "embedding index: 5 images: 3 (models/tiny-llava), 2 (other-model)" in text


def test_redis_not_read_shows_the_coordinator():
    r = report(redis=False)
    assert r["redis"] == {"url": None, "read": False, "error": "unreachable"}
    # Only what the coordinator reports of the workers' caches.
    assert r["caches"] == {"embedding_index": None, "prefix_index": None,
                           "worker_counters": {"decode-0": {"prefix_hits": 7, "cached_blocks": 12}}}
    assert all(w["heartbeat_age_s"] is None and w["seen_by"] == ["coordinator"] for w in r["workers"])
    text = format_report(r)
    assert "redis not read: unreachable" in text
    assert "  embedding index: - (Redis not read)    prefix index: - (Redis not read)" in text

    bare = coordinator_reply()
    del bare["workers"]["decode-0"]["counters"]
    text = format_report(build_report("tcp://c:1", bare, None, None, None, "no --redis given", now=NOW))
    assert "caches\n  (Redis not read)\n" in text
    assert "decode-0" in text and "completed 5" in text


def test_neither_source_says_so_briefly():
    r = build_report("tcp://x:1", None, "no STATUS reply within 1s", None, None, "no --redis given", now=NOW)
    assert format_report(r).splitlines() == ["coordinator tcp://x:1 UNREACHABLE: no STATUS reply within 1s",
                                             "  (and Redis was not read either: nothing more to show)",
                                             "redis not read: no --redis given"]
    assert r["workers"] == [] and r["pools"] == []


def test_unknown_and_missing_fields_are_tolerated():
    """An older or newer coordinator: loads without some fields, extra fields, a worker only Redis knows."""
    coord = {"workers": {"u-0": {"role": "unified", "alive": True, "load": {"queue_len": 1, "future": [1, 2]}},
                         "x-0": {"role": "mystery", "alive": True}},
             "roles": {"unified": 1}, "model": "m", "redis_healthy": False, "extra": 1}
    data = {"workers": {"u-0": {"role": "unified"}, "late-0": {"role": "decode"}}, "loads": {},
            "census": {"emb": {}, "prefix": {}, "counters": {}}}
    r = build_report("tcp://c:1", coord, None, "redis://r", data, None, now=NOW)
    w = {x["id"]: x for x in r["workers"]}
    assert w["u-0"]["queue_len"] == 1 and w["u-0"]["running"] is None and w["u-0"]["kv_used"] is None
    assert w["late-0"]["alive"] is None and w["late-0"]["seen_by"] == ["redis"]
    assert [p["role"] for p in r["pools"]] == ["decode", "unified", "mystery"]
    assert r["stats"] is None and r["coordinator"]["requests_in_flight"] is None
    text = format_report(r)
    assert "alive 'redis': registered in Redis but unknown to this coordinator" in text
    assert "redis down or unset" in text
    assert "embedding index: 0 images    prefix index: 0 blocks" in text
    assert "(coordinator not read)" in text  # no stats key at all


def test_redact_hides_the_password():
    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://user:s3cret@h/1") == "redis://user:***@h/1"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


# ---- real Redis ---------------------------------------------------------------------------------------


def test_census_counts_index_entries_and_counters(redis_url):
    store = RedisStore(redis_url)
    try:
        store.add_embedding("a/model", "e1", "encode-0")
        store.add_embedding("a/model", "e2", "encode-0")
        store.add_embedding("b:model", "e1", "encode-1")
        store.add_prefix_blocks("a/model", "prefill-0", ["p1", "p2", "p3"])
        store.incr_counter("encoded_images", "encode-0", 2)
        store.register_worker("decode-0", {"role": "decode"})
        assert store.census() == {"emb": {"a/model": 2, "b:model": 1}, "prefix": {"a/model": 3},
                                  "counters": {"encode-0": {"encoded_images": 2}}}
    finally:
        store.close()


def test_read_redis_reports_an_unreachable_server_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    data, error = read_redis(f"redis://127.0.0.1:{port}/0", timeout_s=1.0)
    assert data is None and error == "unreachable" and time.monotonic() - t0 < 3
    data, error = read_redis("not-a-url", timeout_s=1.0)
    assert data is None and "ValueError" in error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MSERVE_REDIS", "REDIS_URL")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "mserve.cli", "status", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_cli_coordinator_down_with_redis(redis_url):
    store = RedisStore(redis_url)
    # A long TTL: the entries stand for a live worker through both CLI runs (each seconds on a loaded host),
    # where the default 3 s would let them expire between the two.
    store.register_worker("decode-7", {"role": "decode", "pid": 1}, ttl_s=120)
    store.publish_load("decode-7", {"queue_len": 0, "running": 2, "free_blocks": 10, "total_blocks": 64}, ttl_s=120)
    store.close()
    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = run_status("--coordinator", address, "--redis", redis_url, "--timeout", "0.5")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith(f"coordinator {address} UNREACHABLE: no STATUS reply within 0.5s")
    assert "decode-7" in proc.stdout and "54/64" in proc.stdout
    proc = run_status("--coordinator", address, "--redis", redis_url, "--timeout", "0.5", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["coordinator"]["reachable"] is False and out["redis"]["read"] is True
    assert [(w["id"], w["role"], w["running"]) for w in out["workers"]] == [("decode-7", "decode", 2)]


# ---- a real cluster -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_status_of_a_real_cluster(tiny_model_dirs, redis_url):
    from mserve.coordinator.client import Client
    from mserve.coordinator.launcher import LocalCluster
    from tests.helpers import chat, make_image

    model = str(tiny_model_dirs["llava"])
    # Prefix skips off: the second request must reach the encoder to show its embedding-cache hit.
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_url,
                      extra_coordinator_args=["--prefix-skip", "off"]) as cluster:
        args = ("--coordinator", cluster.address, "--redis", redis_url)
        before = json.loads(run_status(*args, "--json").stdout)
        assert before["coordinator"]["reachable"] and before["redis"]["read"]
        assert {(w["id"], w["role"], w["alive"]) for w in before["workers"]} == {
            ("encode-0", "encode", True), ("prefill-0", "prefill", True), ("decode-0", "decode", True)}
        assert all(w["seen_by"] == ["coordinator", "redis"] and w["heartbeat_age_s"] < 5 for w in before["workers"])
        assert [(p["role"], p["alive"], p["total"]) for p in before["pools"]] == [
            ("encode", 1, 1), ("prefill", 1, 1), ("decode", 1, 1)]

        image = make_image(64, 48, seed=3)
        with Client(cluster.address, timeout_s=120) as client:
            for _ in range(2):  # the second one finds the image's embedding cached
                client.generate(chat("What is this?", [image]), max_tokens=4)

        deadline = time.monotonic() + 10  # prefix blocks reach Redis within a heartbeat (0.25 s)
        while True:
            proc = run_status(*args, "--json")
            after = json.loads(proc.stdout)
            if after["caches"]["prefix_index"].get(model) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert proc.returncode == 0
        assert after["stats"]["completed"] - before["stats"]["completed"] == 2
        assert after["stats"]["admitted"] - before["stats"]["admitted"] == 2
        assert after["coordinator"]["requests_in_flight"] == 0
        assert after["caches"]["embedding_index"] == {model: 1}
        assert after["caches"]["prefix_index"][model] >= 1
        encode_counters = after["caches"]["worker_counters"]["encode-0"]
        assert encode_counters["encoded_images"] == 1 and encode_counters["embedding_cache_hits"] == 1

        proc = run_status(*args)
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        print(text)  # the sample in docs/operations.md comes from here (pytest -s)
        lines = text.splitlines()
        assert lines[0] == f"coordinator {cluster.address}  redis healthy  requests in flight 0  model {model}"
        i = lines.index("workers")
        rows = [line.split() for line in lines[i + 2:i + 5]]
        assert [r[:3] for r in rows] == [["encode-0", "encode", "yes"], ["prefill-0", "prefill", "yes"],
                                         ["decode-0", "decode", "yes"]]
        assert "embedding index: 1 images" in text
        assert f"completed {after['stats']['completed']}" in text
        address = cluster.address

    # The cluster is gone: the coordinator does not answer and the workers deregistered from Redis.
    proc = run_status("--coordinator", address, "--redis", redis_url, "--timeout", "1")
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"coordinator {address} UNREACHABLE: no STATUS reply within 1s")
    assert "redis read from" in proc.stdout


def test_coordinator_shards_in_redis_are_listed(redis_url):
    import time as _time

    from mserve.common.shards import ShardRegistry
    from mserve.status import build_report, format_report, read_redis

    store = RedisStore(redis_url)
    try:
        ShardRegistry(store).announce("shard-1", "tcp://10.0.0.2:5555", "tcp://10.0.0.2:5556", _time.time())
        ShardRegistry(store).announce("shard-0", "tcp://10.0.0.1:5555", "tcp://10.0.0.1:5556", _time.time())
    finally:
        store.close()
    data, error = read_redis(redis_url, 2.0)
    assert error is None and sorted(data["shards"]) == ["shard-0", "shard-1"]
    rep = build_report("tcp://10.0.0.1:5555", None, "no reply", redis_url, data, None, now=_time.time())
    assert "coordinator shards (2): shard-0 tcp://10.0.0.1:5555, shard-1 tcp://10.0.0.2:5555" in format_report(rep)


def test_a_hybrid_models_state_per_sequence_is_shown_beside_the_pool():
    """Qwen3.5's workers report their linear-attention state per running sequence (workers/sizing.py's rule);
    other models' workers report 0 and no line is printed."""
    reply = coordinator_reply()
    for wid in ("prefill-0", "decode-0"):
        reply["workers"][wid]["load"]["state_kib_per_seq"] = 24.0
    text = format_report(build_report("tcp://10.0.0.1:5555", reply, None, None, None, "unset", now=NOW))
    assert "  linear-attention state per sequence, beside the KV pool: prefill-0 24.0 KiB, decode-0 24.0 KiB" in text
    plain = format_report(build_report("tcp://10.0.0.1:5555", coordinator_reply(), None, None, None, "unset", now=NOW))
    assert "linear-attention" not in plain
