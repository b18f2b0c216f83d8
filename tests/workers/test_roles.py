"""Worker roles: typed stage messages, and a real worker process that runs only its own role's stage."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from mserve.common.protocol import MsgType, ProtocolError, parse_message
from mserve.common.protocol.client import Sampling
from mserve.common.protocol.to_coordinator import (TO_COORDINATOR, Encoded, Failed, HandBack, StepTokens, TokenItem,
                                                   registration_of)
from mserve.common.protocol.to_worker import EncodeTask, ImageRef, PrefillTask, RunTask, Shutdown
from mserve.common.sockets import bound_address, make_socket, recv, send
from mserve.common.transfer import TransferEngine
from mserve.workers.engine import Engine, EngineConfig
from tests.helpers import make_image


def test_typed_messages_round_trip_and_name_the_bad_field():
    task = RunTask(request_id="r1", attempt=2, prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
                   images=[ImageRef(hash="h", data=b"png")], priority=-1)
    assert RunTask.from_body(task.to_body()) == task
    items = StepTokens(items=[TokenItem(request_id="r1", attempt=0, token_ids=[5], finished=True, finish_reason="stop",
                                        worker_s=0.5, cached_tokens=16)])
    assert StepTokens.from_body(items.to_body()) == items
    assert "fetch_s" not in items.to_body()["items"][0]  # None fields stay off the wire
    back = HandBack(descriptor={"kv": 1}, token_ids=[1, 2], images=[[0, 4, "h"]], first_block=1)
    last = StepTokens(items=[TokenItem(request_id="r1", attempt=0, token_ids=[5], finished=True, hand_back=back)])
    assert StepTokens.from_body(last.to_body()).items[0].hand_back == back
    bad = PrefillTask(request_id="r", attempt=0, prompt_ids=[1], sampling=Sampling()).to_body()
    for field, value, words in [("prompt_ids", [1, "x"], "PREFILL.prompt_ids[1]: expected an integer"),
                                ("attempt", True, "PREFILL.attempt: expected an integer"),
                                ("embeddings", [1], "PREFILL.embeddings: expected a map"),
                                ("latency_class", "urgent", "PREFILL.latency_class: expected one of interactive, batch")]:
        with pytest.raises(ProtocolError, match=words.replace("[", r"\[").replace("]", r"\]")):
            PrefillTask.from_body({**bad, field: value})
    with pytest.raises(ProtocolError, match="ENCODE: missing field images"):
        EncodeTask.from_body({"request_id": "r", "attempt": 0})
    with pytest.raises(ProtocolError, match=r"ENCODE.images\[0\].data: expected bytes"):
        EncodeTask.from_body({"request_id": "r", "attempt": 0, "images": [{"hash": "h", "data": 3}]})


def _expect(sock: zmq.Socket, kinds: set[MsgType], timeout_s: float = 60.0):
    """The next message of one of `kinds` from the worker (heartbeats are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            _, kind, payload = recv(sock)
            if kind in kinds:
                return MsgType(kind), payload
    raise AssertionError(f"no {sorted(k.name for k in kinds)} from the worker within {timeout_s}s")


@pytest.mark.slow
def test_encode_worker_refuses_other_roles_and_encodes_exactly(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llava"])
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mserve.cli", "worker", "--role", "encode", "--model", model,
                             "--coordinator", bound_address(router), "--worker-id", "enc-under-test",
                             "--host-embedding-cache-dir", str(tmp_path / "l2")],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "wb"))
    receiver = TransferEngine("test-receiver")
    try:
        # READY may be dropped while the DEALER still connects; every heartbeat repeats it.
        kind, ready = _expect(router, {MsgType.READY, MsgType.HEARTBEAT})
        info = registration_of(parse_message(kind, ready, TO_COORDINATOR))
        assert (info.worker_id, info.role) == ("enc-under-test", "encode")
        ident = info.worker_id.encode()
        # A prefill stage sent to an encoder is refused at once, retryable, so it can go elsewhere.
        misrouted = PrefillTask(request_id="r-misrouted", attempt=3, prompt_ids=[1, 2], sampling={})
        send(router, MsgType.PREFILL, misrouted.to_body(), identity=ident)
        _, payload = _expect(router, {MsgType.FAILED, MsgType.ENCODED})
        failed = Failed.from_body(payload)
        assert (failed.request_id, failed.attempt, failed.retryable) == ("r-misrouted", 3, True)
        assert "encode worker refused it" in failed.message and "PREFILL" in failed.message
        # ...and the worker goes on serving its own role: the embedding it sends equals an in-process encode.
        image = make_image(120, 90, seed=7)
        send(router, MsgType.ENCODE, EncodeTask(request_id="r-ok", attempt=0,
                                                images=[ImageRef(hash="img-7", data=image)]).to_body(), identity=ident)
        kind, payload = _expect(router, {MsgType.FAILED, MsgType.ENCODED})
        assert kind is MsgType.ENCODED, payload
        encoded = Encoded.from_body(payload)
        got = receiver.fetch(encoded.descriptor, timeout_s=30)["img0"]
        want = Engine(EngineConfig(model, dtype="float32")).encode([image])[0].embeds
        assert encoded.images[0].tokens == want.shape[0]
        assert torch.equal(got, want)
    finally:
        # As a coordinator would: SHUTDOWN stops it at once (SIGTERM would drain, waiting for a
        # release this bare socket never sends).
        send(router, MsgType.SHUTDOWN, Shutdown().to_body(), identity=b"enc-under-test")
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        receiver.close()
        router.close(0)


def test_encode_batches_take_interactive_first_and_stay_bounded():
    from mserve.workers.roles.encode import next_encode_batch

    def task(rid: str, n: int, cls: str = "batch", priority: int = 0) -> EncodeTask:
        return EncodeTask(request_id=rid, attempt=0, images=[ImageRef(hash=f"{rid}{i}", data=b"x") for i in range(n)],
                          priority=priority, latency_class=cls)

    queue = [task("b1", 3), task("b2", 3), task("i1", 2, "interactive"), task("b3", 1), task("p1", 1, priority=1)]
    batch, rest = next_encode_batch(queue, max_images=6)
    assert [t.request_id for t in batch] == ["p1", "i1", "b1"]  # 6 images; b2 would make 9
    assert [t.request_id for t in rest] == ["b2", "b3"]  # arrival order kept
    batch, rest = next_encode_batch([task("big", 9), task("i2", 1, "interactive")], max_images=4)
    assert [t.request_id for t in batch] == ["i2"] and [t.request_id for t in rest] == ["big"]
    batch, rest = next_encode_batch(rest, max_images=4)
    assert [t.request_id for t in batch] == ["big"] and rest == []  # too big for a batch: it goes alone


def test_video_refs_round_trip_and_weigh_their_frames():
    from mserve.common.video import VideoPart
    from mserve.workers.roles.encode import next_encode_batch, visual_input

    frames = ImageRef(hash="v", data=b"", frames=[b"f0", b"f1", b"f2"])
    clip = ImageRef(hash="c", data=b"mp4", frame_indices=[0, 4])
    task = EncodeTask(request_id="r", attempt=0, images=[frames, clip, ImageRef(hash="i", data=b"png")])
    assert EncodeTask.from_body(task.to_body()) == task
    assert "frames" not in task.to_body()["images"][2]  # an image's ref is unchanged on the wire
    assert [visual_input(im) for im in task.images] == [VideoPart(frames=(b"f0", b"f1", b"f2")),
                                                        VideoPart(data=b"mp4", indices=(0, 4)), b"png"]
    with pytest.raises(ProtocolError, match=r"ENCODE.images\[0\].frames\[1\]: expected bytes"):
        EncodeTask.from_body({"request_id": "r", "attempt": 0, "images": [{"hash": "h", "data": b"", "frames": [b"a", 1]}]})
    other = EncodeTask(request_id="o", attempt=0, images=[ImageRef(hash="j", data=b"png")])
    batch, rest = next_encode_batch([task, other], max_images=6)  # 3 + 2 + 1 frames fill the batch
    assert [t.request_id for t in batch] == ["r"] and [t.request_id for t in rest] == ["o"]
