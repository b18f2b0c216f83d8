"""Single-flight encodes with real processes: a burst for one new image runs the vision tower once, and
when the encoder holding that encode is killed mid-encode a waiter takes over, nothing lost or doubled."""

from __future__ import annotations

import asyncio
import signal

import pytest

from mserve.common.redis_store import RedisStore
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.clusters import LLAVA_2E1P1D_LENDING
from tests.coordinator.test_cluster import expected, generate_all
from tests.helpers import make_image, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[LLAVA_2E1P1D_LENDING], ids=str)
def cluster(request, shared_clusters):
    """2 encode, 1 prefill, 1 decode (shm), shared with tests/coordinator/test_cluster.py's batch (tests/clusters.py):
    its --dead-after-s 3 lets the encoders be stopped (SIGSTOP) for a moment below without being declared dead.
    Its counters and stats are read as differences; the images here are new to it."""
    yield shared_clusters.get(request.param)
    shared_clusters.release(request.param)


def forwards(cluster: LocalCluster) -> dict[str, int]:
    """Images each encode worker has run through its vision tower (its Redis counter)."""
    store = RedisStore(cluster.redis_url)
    try:
        return {w: store.get_counters(w).get("encoded_images", 0) for w in cluster.worker_names("encode")}
    finally:
        store.close()


def status(cluster: LocalCluster) -> dict:
    with Client(cluster.address, timeout_s=10) as c:
        return c.status()


def burst_while_encoders_stopped(cluster: LocalCluster, requests, kill_leader: bool):
    """Send `requests` while every encoder is stopped (SIGSTOP), so the whole burst is in before the
    first encode can end; once one ENCODE is out and the rest are parked, kill its encoder (SIGKILL)
    or not, let the others go on (SIGCONT). (the encoder that got the ENCODE, the results)"""
    encoders = cluster.worker_names("encode")
    for name in encoders:
        cluster.kill_worker(name, signal.SIGSTOP)

    def leader() -> str | None:
        s = status(cluster)
        sent = [w for w in encoders if s["workers"][w]["load"]["inflight"]]
        return sent[0] if len(sent) == 1 and s["encode_parked"] == len(requests) - 1 else None

    async def run():
        replies = asyncio.ensure_future(generate_all(cluster.address, requests))
        victim = await asyncio.to_thread(wait_for, leader, 30, "one ENCODE sent, the other requests parked")
        if kill_leader:
            cluster.kill_worker(victim, signal.SIGKILL)
        for name in encoders:
            if name != victim or not kill_leader:
                cluster.kill_worker(name, signal.SIGCONT)
        return victim, await replies

    return asyncio.run(run())


def test_a_burst_for_one_new_image_encodes_it_once_and_every_reply_matches_hf(cluster, tiny_model_dirs):
    requests = [("Describe the picture.", [make_image(40, 32, seed=1601)])] * 16
    before, dedup = forwards(cluster), status(cluster)["stats"]["encode_deduplicated"]
    leader, results = burst_while_encoders_stopped(cluster, requests, kill_leader=False)
    after = forwards(cluster)
    assert after[leader] - before[leader] == 1 and sum(after.values()) - sum(before.values()) == 1, (before, after)
    assert status(cluster)["stats"]["encode_deduplicated"] - dedup == 15
    want = expected(str(tiny_model_dirs["llava"]), requests[:1])[0]
    assert [r.token_ids for r in results] == [want] * 16
    assert sorted(r.cache_hits["embedding"] for r in results) == [0] + [1] * 15
    assert all(r.attempts == 1 for r in results)


def test_the_encoder_of_the_single_flight_is_killed_mid_encode_and_a_waiter_takes_over(cluster, tiny_model_dirs):
    requests = [("What is here?", [make_image(36, 44, seed=1602)])] * 6
    before, dedup = forwards(cluster), status(cluster)["stats"]["encode_deduplicated"]
    victim, results = burst_while_encoders_stopped(cluster, requests, kill_leader=True)
    after = forwards(cluster)
    assert after[victim] == before[victim]  # killed before its vision forward
    assert sum(after.values()) - sum(before.values()) == 1, (before, after)
    want = expected(str(tiny_model_dirs["llava"]), requests[:1])[0]
    assert [r.token_ids for r in results] == [want] * 6
    # Only the killed encode's request re-ran; a waiter took the encode over (the one request that ran
    # the vision tower), and the re-run request waited for it and read the image back like the rest.
    assert sorted((r.attempts, r.cache_hits["embedding"]) for r in results) == [(1, 0)] + [(1, 1)] * 4 + [(2, 1)]
    assert status(cluster)["stats"]["encode_deduplicated"] - dedup == 5
