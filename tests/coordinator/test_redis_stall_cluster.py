"""A stalled Redis stalls no request: a real 1e1p1d cluster (coordinator and three workers) over a real
redis-server paused with SIGSTOP, every process's Redis timeout 10 s.

Every Redis call of theirs would then wait 10 s. The workers make theirs on their Redis lane
(common/redis_lane.py, tests/workers/test_redis_stall_worker.py); the coordinator polls loads, announces and
writes leases there too, and reads its routing hints (prefix and embedding holders, encode leases) only
while Redis answers (coordinator/coordinator_redis.py). So once the coordinator has seen the stall (its
status says Redis is not healthy), image requests go through encode, prefill and decode HF-exact in a
small part of one timeout; and when Redis resumes, the coordinator finds it healthy again by itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mserve.common.redis_server import RedisServer, find_redis_server
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected, generate_all
from tests.helpers import request_mix, wait_for

pytestmark = pytest.mark.slow
REDIS_TIMEOUT_S = 10.0
TIMEOUT_ARGS = ["--redis-timeout-s", str(REDIS_TIMEOUT_S)]


def _redis_healthy(address: str) -> bool | None:
    with Client(address, timeout_s=5) as client:
        return client.status()["redis_healthy"]


def test_a_stalled_redis_stalls_no_request(tiny_model_dirs):
    model = str(tiny_model_dirs["llava"])
    warm, during, after = request_mix(2, seed=61), request_mix(4, seed=62), request_mix(2, seed=63)
    server = RedisServer(binary=find_redis_server()).start()
    paused = False
    try:
        with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=server.url,
                          extra_worker_args=TIMEOUT_ARGS, extra_coordinator_args=TIMEOUT_ARGS) as cluster:
            first = asyncio.run(generate_all(cluster.address, warm))
            assert _redis_healthy(cluster.address) is True
            os.kill(server.pid, signal.SIGSTOP)
            paused = True
            # The coordinator's lane is stuck in a call: routing stops asking Redis (its loop answers STATUS).
            wait_for(lambda: _redis_healthy(cluster.address) is False, timeout_s=REDIS_TIMEOUT_S / 2,
                     what="the coordinator to see Redis stalled")
            t0 = time.monotonic()
            stalled = asyncio.run(generate_all(cluster.address, during))
            took = time.monotonic() - t0
            os.kill(server.pid, signal.SIGCONT)
            paused = False
            wait_for(lambda: _redis_healthy(cluster.address) is True, timeout_s=3 * REDIS_TIMEOUT_S,
                     what="the coordinator to find Redis answering again")
            last = asyncio.run(generate_all(cluster.address, after))
    finally:
        if paused:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
    assert took < REDIS_TIMEOUT_S / 3, f"{len(during)} requests took {took:.2f} s with Redis paused"
    assert [r.token_ids for r in first] == expected(model, warm)
    assert [r.token_ids for r in stalled] == expected(model, during)
    assert [r.token_ids for r in last] == expected(model, after)
