"""A stalled KV sender delays only its own request: real prefill and decode workers, real sockets.

The test plays the coordinator (one ROUTER both workers connect to). One request decodes on the decode
worker when a second arrives whose KV descriptor points at a listener that takes the fetch and never
answers, and two more arrive behind it. The decode worker fetches on IO threads (workers/fetcher.py):
the three others finish HF-exact long before the stalled fetch times out, and the stalled request ends
in a retryable FAILED once it does. (With the fetch on the loop thread, the two behind it would wait
the whole timeout. The tiny model decodes in about a millisecond a step, so token gaps as the test
receives them say little: finishing times do.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from mserve.common.protocol import MsgType, parse_message
from mserve.common.protocol.client import Sampling
from mserve.common.protocol.to_coordinator import TO_COORDINATOR, Failed, Prefilled, StepTokens, registration_of
from mserve.common.protocol.to_worker import DecodeTask, PrefillTask, Shutdown
from mserve.common.sockets import bound_address, make_socket, recv, send
from tests.helpers import hf_generate

pytestmark = pytest.mark.slow
TOKENS = 160  # long enough that the three are still decoding when the stalled one arrives
FETCH_TIMEOUT_S = 4.0  # the workers' --fetch-timeout-s: short, so the test waits 4 s for the stall, not 10


def _worker(role: str, model: str, coordinator: str, log_path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "mserve.cli", "worker", "--role", role, "--model", model,
                             "--coordinator", coordinator, "--worker-id", f"{role}-under-test", "--transfer", "tcp",
                             "--fetch-timeout-s", str(FETCH_TIMEOUT_S)],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))


def _next(router: zmq.Socket, kinds: set[MsgType], timeout_s: float = 120.0) -> tuple[MsgType, dict, float]:
    """The next message of one of `kinds` from either worker, and when it came (heartbeats skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.poll(50):
            _, kind, payload = recv(router)
            if kind in kinds:
                return MsgType(kind), payload, time.monotonic()
    raise AssertionError(f"no {sorted(k.name for k in kinds)} from the workers within {timeout_s}s")


def test_a_stalled_kv_sender_delays_only_its_own_request(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llava"])
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    silent = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")  # takes the fetch, never replies
    procs = [_worker(role, model, bound_address(router), tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    prompts = {f"r{i}": [1] + [(37 * i + 11 * j) % 500 + 3 for j in range(12 + 3 * i)] for i in range(4)}
    try:
        seen = set()
        while seen != {"prefill-under-test", "decode-under-test"}:  # READY may be dropped; heartbeats repeat it
            kind, body, _ = _next(router, {MsgType.READY, MsgType.HEARTBEAT})
            seen.add(registration_of(parse_message(kind, body, TO_COORDINATOR)).worker_id)
        sampling = Sampling(max_tokens=TOKENS, ignore_eos=True)
        for rid, ids in prompts.items():
            send(router, MsgType.PREFILL, PrefillTask(request_id=rid, attempt=0, prompt_ids=ids,
                                                      sampling=sampling).to_body(), identity=b"prefill-under-test")
        prefilled = {}
        while len(prefilled) < len(prompts):
            _, body, _ = _next(router, {MsgType.PREFILLED})
            msg = Prefilled.from_body(body)
            prefilled[msg.request_id] = msg
        tokens = {rid: [prefilled[rid].token_id] for rid in prompts}

        def decode(rid: str, descriptor: dict) -> None:
            send(router, MsgType.DECODE, DecodeTask(request_id=rid, attempt=0, descriptor=descriptor,
                                                    state=prefilled[rid].state).to_body(), identity=b"decode-under-test")

        decode("r0", prefilled["r0"].descriptor)
        while len(tokens["r0"]) < 2:  # r0 is running
            _, body, _ = _next(router, {MsgType.STEP_TOKENS, MsgType.FAILED})
            for item in StepTokens.from_body(body).items:
                tokens[item.request_id] += item.token_ids
        # The stalled request, then two more behind it on the same link: a fetch on the loop thread would
        # hold them (and r0) until it timed out.
        decode("r3", {**prefilled["r3"].descriptor, "address": bound_address(silent)})
        sent_at = time.monotonic()
        decode("r1", prefilled["r1"].descriptor)
        decode("r2", prefilled["r2"].descriptor)
        finished, failed = {}, None
        while failed is None or len(finished) < 3:
            kind, body, at = _next(router, {MsgType.STEP_TOKENS, MsgType.FAILED}, timeout_s=3 * FETCH_TIMEOUT_S)
            if kind is MsgType.FAILED:
                failed, failed_at = Failed.from_body(body), at
                continue
            for item in StepTokens.from_body(body).items:
                tokens[item.request_id] += item.token_ids
                if item.finished:
                    finished[item.request_id] = at
    finally:
        for name in (b"prefill-under-test", b"decode-under-test"):
            send(router, MsgType.SHUTDOWN, Shutdown().to_body(), identity=name)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        router.close(0)
        silent.close(0)
    # The stalled request: an explicit, retryable failure after the fetch timeout, naming the transfer.
    assert (failed.request_id, failed.attempt, failed.retryable) == ("r3", 0, True)
    assert "transfer failed" in failed.message, failed.message
    assert failed_at - sent_at >= FETCH_TIMEOUT_S * 0.9
    # The others went on through the stall: r1 and r2, sent after it, decoded all their tokens well within
    # the fetch timeout, and all three finished before the stalled fetch gave up.
    assert "r3" not in finished
    assert max(finished.values()) - sent_at < FETCH_TIMEOUT_S / 3, {k: v - sent_at for k, v in finished.items()}
    assert max(finished.values()) < failed_at
    for rid in ("r0", "r1", "r2"):
        assert tokens[rid] == hf_generate(model, prompts[rid], [], TOKENS, ignore_eos=True), rid
