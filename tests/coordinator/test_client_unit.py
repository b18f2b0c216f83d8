"""Client pure parts, no cluster: message normalization, error mapping, reply assembly, module imports, token
chunks against an in-test ROUTER, launcher commands."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from mserve.common import protocol
from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.client import FROM_CLIENT
from mserve.common.serde import SCHEMA_VERSION
from mserve.common.sockets import make_socket, recv, send
from mserve.coordinator.client import (
    Aborted,
    AsyncClient,
    BadRequest,
    GenerateResult,
    MServeError,
    NoWorkers,
    Overloaded,
    RequestTimeout,
    ServerError,
    error_from_reply,
    normalize_client_messages,
)
from mserve.coordinator.client_core import Assembler, generate_body
from mserve.coordinator.launcher import LocalCluster
from tests.helpers import make_image

IMAGE = make_image(32, 24, seed=1)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def only_image(messages):
    (part,) = [p for p in messages[0]["content"] if p["type"] == "image"]
    return part["image"]


# ---- normalize_client_messages


def test_bytes_part_passes_through_as_bytes():
    out = normalize_client_messages(user({"type": "image", "image": bytearray(IMAGE)}, {"type": "text", "text": "hi"}))
    assert only_image(out) == IMAGE and type(only_image(out)) is bytes
    assert out[0]["content"][1] == {"type": "text", "text": "hi"}


@pytest.mark.parametrize("as_path", [str, Path])
def test_file_path_is_read(tmp_path, as_path):
    f = tmp_path / "cat.png"
    f.write_bytes(IMAGE)
    assert only_image(normalize_client_messages(user({"type": "image", "image": as_path(f)}))) == IMAGE


def test_data_url_is_decoded():
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    assert only_image(normalize_client_messages(user({"type": "image", "image": url}))) == IMAGE


@pytest.mark.parametrize("image_url", ["DATA", {"url": "DATA"}])
def test_openai_image_url_part_becomes_image_part(image_url):
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    image_url = url if image_url == "DATA" else {"url": url}
    out = normalize_client_messages(user({"type": "image_url", "image_url": image_url}))
    assert out[0]["content"] == [{"type": "image", "image": IMAGE}]


def test_missing_file_names_the_part(tmp_path):
    missing = str(tmp_path / "nope.png")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*does not exist"):
        normalize_client_messages(user({"type": "text", "text": "x"}, {"type": "image", "image": missing}))


@pytest.mark.parametrize("part, pattern", [
    ({"type": "hologram", "hologram": b"x"}, "unsupported part type 'hologram'"),
    ("just a string", "unsupported part type None"),
    ({"type": "image", "image": 42}, "no usable image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "not fetched"),
])
def test_unsupported_parts_are_refused(part, pattern):
    with pytest.raises(ValueError, match=pattern):
        normalize_client_messages(user(part))


@pytest.mark.parametrize("messages", [[], "hello", None, [{"role": "user", "content": 3}], ["not a dict"]])
def test_malformed_message_lists_are_refused(messages):
    with pytest.raises(ValueError):
        normalize_client_messages(messages)


def test_input_is_not_modified_and_extra_keys_survive(tmp_path):
    f = tmp_path / "a.png"
    f.write_bytes(IMAGE)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "name": "ann", "content": [{"type": "image", "image": str(f)}]}]
    out = normalize_client_messages(messages)
    assert messages[1]["content"][0]["image"] == str(f)
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1]["name"] == "ann" and only_image(out[1:]) == IMAGE


def test_generate_body_has_the_protocol_fields():
    body = generate_body("r1", user({"type": "text", "text": "hi"}), True, max_tokens=5, seed=3,
                         stop_token_ids=(7, 8), latency_class="batch", priority=2)
    assert body["v"] == SCHEMA_VERSION
    assert protocol.parse_message(MsgType.GENERATE, body, FROM_CLIENT).to_body() == body
    assert body["sampling"] == {"max_tokens": 5, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 3,
                                "stop_token_ids": [7, 8], "ignore_eos": False}
    assert (body["stream"], body["priority"], body["latency_class"]) == (True, 2, "batch")


# ---- error mapping


@pytest.mark.parametrize("code, cls", [
    (ErrorCode.BAD_REQUEST, BadRequest), (ErrorCode.BAD_MESSAGE, BadRequest), (ErrorCode.OVERLOADED, Overloaded),
    (ErrorCode.NO_WORKERS, NoWorkers), (ErrorCode.TIMEOUT, RequestTimeout), (ErrorCode.ABORTED, Aborted),
    (ErrorCode.INTERNAL, ServerError), ("some_future_code", ServerError),
])
def test_error_codes_map_to_exceptions(code, cls):
    exc = error_from_reply({"request_id": "r9", "code": code, "message": "max_tokens 9000 > limit 4096"})
    assert type(exc) is cls and isinstance(exc, MServeError)
    assert (exc.code, exc.request_id, exc.message) == (code, "r9", "max_tokens 9000 > limit 4096")
    assert "max_tokens 9000" in str(exc) and "r9" in str(exc)
    assert exc.retry_after_s is None


def test_overloaded_carries_the_retry_after_hint():
    exc = error_from_reply({"request_id": "r1", "code": ErrorCode.OVERLOADED, "message": "full", "retry_after_s": 2.5})
    assert isinstance(exc, Overloaded) and exc.retry_after_s == 2.5


# ---- reply assembly


def tokens(index, ids, rid="r"):
    return MsgType.TOKENS, {"request_id": rid, "index": index, "token_ids": ids}


def result(ids, rid="r"):
    return MsgType.RESULT, {"request_id": rid, "token_ids": ids, "text": "t", "finish_reason": "length",
                            "timings": {"total_s": 0.5}, "prompt_tokens": 9, "visual_tokens": 4,
                            "cache_hits": {"embedding": 1, "prefix_tokens": 0}, "attempts": 2}


def test_assembler_drops_resent_overlap():
    asm = Assembler("r")
    for reply in (tokens(0, [1, 2]), tokens(2, [3]), tokens(1, [2, 3, 4]), tokens(0, [1]), result([1, 2, 3, 4])):
        asm.feed(*reply)
    assert list(asm.ready) == [1, 2, 3, 4] and asm.finished
    assert asm.result == GenerateResult("r", [1, 2, 3, 4], "t", "length", 9, 4, {"total_s": 0.5},
                                        {"embedding": 1, "prefix_tokens": 0}, 2)


def test_assembler_hands_out_result_tail_not_streamed():
    asm = Assembler("r")
    asm.feed(*tokens(0, [5]))
    asm.feed(*result([5, 6, 7]))
    assert list(asm.ready) == [5, 6, 7]


def test_assembler_refuses_a_gap():
    asm = Assembler("r")
    asm.feed(*tokens(0, [1]))
    with pytest.raises(ServerError, match="gap: expected index 1, got 3"):
        asm.feed(*tokens(3, [4]))
    assert not asm.finished


def test_a_reordering_assembler_waits_for_a_late_chunk():
    """Direct tokens: the worker's chunks may overtake the coordinator's first token."""
    asm = Assembler("r", reorder=True)
    asm.feed(*tokens(2, [3, 4]))
    asm.feed(*tokens(1, [2]))
    assert list(asm.ready) == [] and asm.num_received == 0
    asm.feed(*tokens(0, [1]))
    assert list(asm.ready) == [1, 2, 3, 4]
    asm.feed(*tokens(3, [4, 5]))  # a re-run streams some again
    asm.feed(*tokens(7, [8]))  # lost ahead of a gap: RESULT fills it
    asm.feed(*result([1, 2, 3, 4, 5, 6, 7, 8]))
    assert list(asm.ready) == [1, 2, 3, 4, 5, 6, 7, 8] and asm.finished


def test_a_result_that_contradicts_the_stream_fails_loudly():
    asm = Assembler("r", reorder=True)
    asm.feed(*tokens(0, [1, 2]))
    with pytest.raises(ServerError, match="differ"):
        asm.feed(*result([1, 9, 3]))


def test_assembler_error_ends_the_request_with_our_id():
    asm = Assembler("r")
    with pytest.raises(Overloaded) as info:
        asm.feed(MsgType.ERROR, {"request_id": None, "code": ErrorCode.OVERLOADED, "message": "queue full"})
    assert asm.finished and info.value.request_id == "r"


def test_result_body_without_optional_fields():
    r = GenerateResult.from_body({"request_id": "r", "token_ids": [], "text": "", "finish_reason": "stop",
                                  "timings": {}})
    assert (r.prompt_tokens, r.visual_tokens, r.cache_hits, r.attempts) == (0, 0, {}, 1)


# ---- module structure


@pytest.mark.parametrize("modules", [("async_client", "client"), ("client", "async_client")])
def test_client_modules_import_alone_in_either_order_without_torch(modules):
    imports = ", ".join(f"mserve.coordinator.{m}" for m in modules)
    code = (f"import {imports}, mserve.common.sockets, mserve.common.protocol, mserve.common.serde, sys\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "from mserve.coordinator.client import AsyncClient, Client, MServeError\n"
            "from mserve.coordinator import async_client\n"
            "assert AsyncClient is async_client.AsyncClient\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr


# ---- AsyncClient against an in-test ROUTER (no cluster)


async def _serve_chunks(router: zmq.Socket, replies: list[tuple[MsgType, dict]]) -> list[list[int]]:
    """Answer one GENERATE with `replies` (all sent at once) and collect the stream's chunks."""
    async with AsyncClient(router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=10,
                           poll_interval_s=0.005) as client:
        stream = client.stream(user({"type": "text", "text": "hi"}), request_id="r", max_tokens=4)
        chunks = stream.chunks()
        first = asyncio.ensure_future(chunks.__anext__())  # sends GENERATE
        loop = asyncio.get_running_loop()
        identity, kind, body = await loop.run_in_executor(None, lambda: recv(router))
        assert (kind, body["request_id"], body["stream"]) == (MsgType.GENERATE, "r", True)
        for reply_kind, reply in replies:
            send(router, reply_kind, protocol.body(**reply), identity=identity)
        got = [await first]
        got += [ids async for ids in chunks]
        assert stream.done and stream.result is not None and stream.result.token_ids == [1, 2, 3, 4]
        return got


def test_async_stream_chunks_group_tokens_by_reply():
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    try:
        got = asyncio.run(_serve_chunks(router, [tokens(0, [1, 2]), tokens(2, [3]), result([1, 2, 3, 4])]))
    finally:
        router.close(linger=0)
        ctx.term()
    assert got == [[1, 2], [3], [4]]  # the last token only came with RESULT


def test_async_client_refuses_a_bad_poll_interval():
    with pytest.raises(ValueError, match="poll_interval_s"):
        AsyncClient("tcp://127.0.0.1:1", poll_interval_s=0)


# ---- launcher commands (nothing started)


def test_cluster_names_and_commands():
    c = LocalCluster("/m", encode=1, prefill=2, decode=1, unified=1, redis_url="redis://127.0.0.1:1/0", port=7000,
                     threads=2, transfer="tcp", extra_worker_args=["--device", "cpu"])
    assert c.worker_names() == ["encode-0", "prefill-0", "prefill-1", "decode-0", "unified-0"]
    assert c.worker_names("prefill") == ["prefill-0", "prefill-1"]
    assert c.address == "tcp://127.0.0.1:7000"
    c._worker_port = 7001
    assert c.coordinator_command()[:3] == [sys.executable, "-m", "mserve.cli"]
    assert c.coordinator_command()[3:] == ["coordinator", "--model", "/m", "--bind", "tcp://127.0.0.1:7000",
                                           "--worker-bind", "tcp://127.0.0.1:7001", "--redis", "redis://127.0.0.1:1/0"]
    assert c.worker_command("prefill-1")[3:] == [
        "worker", "--role", "prefill", "--model", "/m", "--coordinator", "tcp://127.0.0.1:7001",
        "--redis", "redis://127.0.0.1:1/0", "--threads", "2", "--transfer", "tcp", "--worker-id", "prefill-1",
        "--device", "cpu"]


@pytest.mark.parametrize("counts", [dict(encode=0, prefill=0, decode=0), dict(encode=-1)])
def test_cluster_refuses_bad_worker_counts(counts):
    with pytest.raises(ValueError, match="worker counts"):
        LocalCluster("/m", **counts)


def test_video_parts_pass_as_frame_bytes_or_file_bytes(tmp_path):
    other = make_image(32, 24, seed=2)
    (tmp_path / "f1.png").write_bytes(other)
    (tmp_path / "clip.mp4").write_bytes(b"not really a video")
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    out = normalize_client_messages(user({"type": "video", "video": [url, tmp_path / "f1.png", bytearray(IMAGE)]},
                                         {"type": "video", "video": str(tmp_path / "clip.mp4")}))
    assert out[0]["content"] == [{"type": "video", "video": [IMAGE, other, IMAGE]},
                                 {"type": "video", "video": b"not really a video"}]
    assert all(type(f) is bytes for f in out[0]["content"][0]["video"])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: video part has no frames"):
        normalize_client_messages(user({"type": "video", "video": []}))


# ---- a coordinator that lost the request (it restarted): the client asks, then fails it as Lost


def _forgetful_router(ctx, answer_probe: bool):
    """A ROUTER that takes GENERATE and never answers it; probes get `unknown_requests` (if asked to). It
    serves until its `stop` event is set (the test's end, not a stretch of silence the test would wait out)."""
    import threading

    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    probes: list[list[str]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            identity, kind, body = recv(router)
            if kind == MsgType.STATUS and "request_ids" in body:
                probes.append(list(body["request_ids"]))
                if answer_probe:
                    send(router, MsgType.STATUS_REPLY, protocol.body(workers={}, unknown_requests=body["request_ids"]),
                         identity=identity)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return router, probes, thread, stop


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_request_the_coordinator_lost_ends_as_lost_not_at_the_timeout(flavour):
    import time

    from mserve.coordinator.client import Client, Lost

    ctx = zmq.Context()
    router, probes, thread, stop = _forgetful_router(ctx, answer_probe=True)
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    t0 = time.monotonic()
    try:
        with pytest.raises(Lost, match="no longer holds this request") as info:
            if flavour == "sync":
                with Client(address, timeout_s=30, probe_after_s=0.3) as c:
                    c.generate(user({"type": "text", "text": "hi"}), request_id="gone")
            else:
                async def go():
                    async with AsyncClient(address, timeout_s=30, probe_after_s=0.3, poll_interval_s=0.01) as c:
                        await c.generate(user({"type": "text", "text": "hi"}), request_id="gone")
                asyncio.run(go())
        assert info.value.code == ErrorCode.LOST and info.value.request_id == "gone"
        assert time.monotonic() - t0 < 10, "the client waited for its timeout instead of asking"
        assert probes and probes[0] == ["gone"]
    finally:
        stop.set()
        thread.join(10)
        router.close(linger=0)
        ctx.term()


def test_a_silent_but_known_request_keeps_waiting_until_its_timeout():
    from mserve.coordinator.client import Client

    ctx = zmq.Context()
    router, probes, thread, stop = _forgetful_router(ctx, answer_probe=False)  # probes unanswered: still "held"
    try:
        with Client(router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=1.2, probe_after_s=0.3) as c:
            with pytest.raises(RequestTimeout):
                c.generate(user({"type": "text", "text": "hi"}), request_id="slow")
        assert len(probes) >= 2  # it kept asking while it waited
    finally:
        stop.set()
        thread.join(10)
        router.close(linger=0)
        ctx.term()
