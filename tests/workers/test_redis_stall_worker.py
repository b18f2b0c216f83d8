"""A stalled Redis holds no engine step and no heartbeat: a real unified worker, a real redis-server paused
with SIGSTOP, real sockets.

The test plays the coordinator (one ROUTER the worker connects to). With Redis answering, a first request
lands in the prefix and embedding indexes. Then Redis is paused, and every Redis call the worker makes
waits its `--redis-timeout-s` (10 s here). Three image requests sent meanwhile finish, HF-exact, in a small
part of that, and heartbeats keep their 0.25 s pace: the worker's Redis calls run on its Redis lane
(common/redis_lane.py), not on the loop or the heartbeat thread. (Before the lane, the loop's prefix index
flush and the tiers' embedding index writes waited the whole timeout, and so did every running decode.)
Once Redis resumes, both indexes catch up with what the paused requests cached and encoded, and a
SHUTDOWN takes the worker's entries out and deregisters it.

The second test keeps Redis paused past a short timeout, so the store counts it down and drops the
embedding index writes meanwhile; when Redis answers again the worker republishes its entries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from mserve.common.images import image_hash
from mserve.common.prompt import PromptBuilder
from mserve.common.protocol import MsgType
from mserve.common.protocol.client import Sampling
from mserve.common.protocol.to_coordinator import StepTokens
from mserve.common.protocol.to_worker import ImageRef, RunTask, Shutdown
from mserve.common.redis_server import RedisServer, find_redis_server
from mserve.common.redis_store import RedisStore
from mserve.common.sockets import bound_address, make_socket, recv, send
from tests.helpers import PROMPTS, hf_generate, make_image, wait_for

pytestmark = pytest.mark.slow
REDIS_TIMEOUT_S = 10.0  # each Redis call of the worker's waits this long while Redis is paused
TOKENS = 96
WORKER = "unified-under-test"
MODEL_NAME = "tiny"


def _start_worker(model: str, router: zmq.Socket, redis_url: str, timeout_s: float, tmp_path) -> subprocess.Popen:
    """A unified worker connected to `router` (the test plays the coordinator), once it said READY."""
    proc = subprocess.Popen([sys.executable, "-m", "mserve.cli", "worker", "--role", "unified", "--model", model,
                             "--model-name", MODEL_NAME, "--coordinator", bound_address(router), "--worker-id", WORKER,
                             "--redis", redis_url, "--redis-timeout-s", str(timeout_s),
                             "--host-embedding-cache-dir", str(tmp_path / "l2")],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "worker.log", "wb"))
    wait_for(lambda: router.poll(50) and recv(router)[1] in (MsgType.READY, MsgType.HEARTBEAT), timeout_s=120,
             what="the worker's READY")
    return proc


def _stop_worker(router: zmq.Socket, proc: subprocess.Popen, server: RedisServer, paused: bool) -> None:
    """Redis resumed if still paused; then, as a coordinator would, SHUTDOWN: the worker exits (its goodbye
    to Redis included)."""
    if paused:
        os.kill(server.pid, signal.SIGCONT)
    try:
        send(router, MsgType.SHUTDOWN, Shutdown().to_body(), identity=WORKER.encode())
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        router.close(0)


def _run(router: zmq.Socket, rid: str, pp, image: bytes) -> None:
    task = RunTask(request_id=rid, attempt=0, prompt_ids=pp.prompt_ids,
                   sampling=Sampling(max_tokens=TOKENS, ignore_eos=True),
                   images=[ImageRef(hash=image_hash(image), data=image)])
    send(router, MsgType.RUN, task.to_body(), identity=WORKER.encode())


def _serve(router: zmq.Socket, rids: set[str], heartbeats: list[float], timeout_s: float = 60.0) -> dict[str, tuple]:
    """Every token of `rids` until each finished: rid -> (tokens, finished at); heartbeat arrivals noted."""
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    finished: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(rids):
        assert time.monotonic() < deadline, f"only {sorted(finished)} of {sorted(rids)} finished in {timeout_s}s"
        if not router.poll(50):
            continue
        _, kind, payload = recv(router)
        now = time.monotonic()
        if kind == MsgType.HEARTBEAT:
            heartbeats.append(now)
        elif kind == MsgType.FAILED:
            raise AssertionError(f"a request failed: {payload}")
        elif kind == MsgType.STEP_TOKENS:
            for item in StepTokens.from_body(payload).items:
                tokens[item.request_id] += item.token_ids
                if item.finished:
                    finished[item.request_id] = now
    return {rid: (tokens[rid], finished[rid]) for rid in rids}


def test_a_stalled_redis_holds_no_step_and_no_heartbeat(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llava"])
    builder = PromptBuilder(model)
    images = [make_image(96 + 16 * i, 80, seed=40 + i) for i in range(4)]
    prompts = [builder.prepare_text(PROMPTS[i], [images[i]]) for i in range(4)]
    server = RedisServer(binary=find_redis_server()).start()
    store = RedisStore(server.url)
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    proc = _start_worker(model, router, server.url, REDIS_TIMEOUT_S, tmp_path)
    paused = False
    try:
        # Redis answering: the first request lands in both indexes.
        _run(router, "r0", prompts[0], images[0])
        _serve(router, {"r0"}, [])
        wait_for(lambda: WORKER in store.lookup_embedding(MODEL_NAME, image_hash(images[0])),
                 what="r0's embedding index entry")
        wait_for(lambda: store.prefix_blocks_of(MODEL_NAME, WORKER), what="r0's prefix index entries")
        before = store.prefix_blocks_of(MODEL_NAME, WORKER)

        os.kill(server.pid, signal.SIGSTOP)
        paused = True
        heartbeats: list[float] = []
        sent_at = time.monotonic()
        for i in (1, 2, 3):
            _run(router, f"r{i}", prompts[i], images[i])
        done = _serve(router, {"r1", "r2", "r3"}, heartbeats)
        while time.monotonic() - sent_at < 3.0:  # heartbeats over a few seconds of the pause
            if router.poll(50) and recv(router)[1] == MsgType.HEARTBEAT:
                heartbeats.append(time.monotonic())
        took = {rid: round(at - sent_at, 2) for rid, (_, at) in done.items()}
        gaps = [b - a for a, b in zip([sent_at] + heartbeats, heartbeats + [time.monotonic()])]

        os.kill(server.pid, signal.SIGCONT)
        paused = False
        # What the paused requests cached and encoded reaches both indexes once Redis answers again: the
        # writes waited on the lane (the pause was shorter than the timeout, so none was dropped).
        wait_for(lambda: len(store.prefix_blocks_of(MODEL_NAME, WORKER) - before) > 0, timeout_s=3 * REDIS_TIMEOUT_S,
                 what="the prefix index to catch up after the pause")
        wait_for(lambda: all(WORKER in store.lookup_embedding(MODEL_NAME, image_hash(images[i])) for i in (1, 2, 3)),
                 timeout_s=3 * REDIS_TIMEOUT_S, what="the embedding index to catch up after the pause")
    finally:
        _stop_worker(router, proc, server, paused)
    try:
        # The goodbye went through the lane too: entries out, registration gone.
        assert store.prefix_blocks_of(MODEL_NAME, WORKER) == set()
        assert WORKER not in store.list_workers()
    finally:
        store.close()
        server.stop()
    # The pause held nothing: the three finished well inside one Redis timeout, and heartbeats kept coming.
    assert max(took.values()) < REDIS_TIMEOUT_S / 3, took
    assert len(heartbeats) >= 4 and max(gaps) < REDIS_TIMEOUT_S / 4, [round(g, 2) for g in gaps]
    for i in (1, 2, 3):
        assert done[f"r{i}"][0] == hf_generate(model, prompts[i].prompt_ids, prompts[i].images, TOKENS,
                                               ignore_eos=True), f"r{i}"


def test_index_writes_dropped_in_an_outage_are_republished_when_redis_answers(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llava"])
    builder = PromptBuilder(model)
    image = make_image(112, 80, seed=70)
    prompt = builder.prepare_text(PROMPTS[0], [image])
    server = RedisServer(binary=find_redis_server()).start()
    store = RedisStore(server.url)
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    log_path = tmp_path / "worker.log"
    proc = _start_worker(model, router, server.url, 0.3, tmp_path)
    paused = False
    try:
        os.kill(server.pid, signal.SIGSTOP)
        paused = True
        wait_for(lambda: b"redis unreachable" in log_path.read_bytes(), timeout_s=30,
                 what="the worker to count Redis down")
        _run(router, "r0", prompt, image)  # encoded while Redis is down: its index write is dropped
        _serve(router, {"r0"}, [])
        os.kill(server.pid, signal.SIGCONT)
        paused = False
        wait_for(lambda: WORKER in store.lookup_embedding(MODEL_NAME, image_hash(image)), timeout_s=30,
                 what="the worker to republish the embedding index entry Redis missed")
        assert b"index entries republished" in log_path.read_bytes()
    finally:
        try:
            _stop_worker(router, proc, server, paused)
        finally:
            store.close()
            server.stop()
