"""HTTP client against a tiny in-test SSE server: timings, usage, and errors as records."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from typing import Any

from mserve.bench.http_target import HttpOptions, build_payload, run_request
from mserve.bench.traces import make_trace

DELAYS_S = [0.05, 0.02, 0.02, 0.02, 0.02]  # before each of the 5 content chunks


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[dict[str, Any]]) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = json.loads(await reader.readexactly(int(headers["content-length"])))
    seen.append({"request_line": lines[0], "headers": headers, "body": body})
    model = body["model"]

    if model == "bad":
        err = json.dumps({"error": {"message": "model not found", "code": 400}}).encode()
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(err)}\r\n\r\n".encode() + err)
        await writer.drain()
        writer.close()
        return

    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

    async def send(payload: str, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        data = f"data: {payload}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    def chunk(delta: dict[str, Any]) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    await send(chunk({"role": "assistant", "content": ""}))  # role chunk: not a token
    if model == "malformed":
        await send("{not json", 0.01)
    else:
        for i, delay in enumerate(DELAYS_S):
            await send(chunk({"content": f"tok{i} "}), delay)
        if model != "truncated":
            usage = {"prompt_tokens": 42, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}
            await send(json.dumps({"choices": [], "usage": usage}))
            await send("[DONE]")
    if model != "truncated":
        writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


REQ = make_trace("image", 1, seed=0, resolutions=[((32, 32), 1.0)], max_tokens=5)[0]


async def _with_server(models: list[str]) -> tuple[list, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    server = await asyncio.start_server(lambda r, w: _handle(r, w, seen), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    opts = HttpOptions(api_key="k", extra_body={"ignore_eos": True})
    async with server:
        recs = await asyncio.gather(*(run_request(opts, f"http://127.0.0.1:{port}/v1", m, REQ) for m in models))
    return list(recs), seen


def test_streamed_tokens_are_timed_and_usage_read() -> None:
    (r,), seen = asyncio.run(_with_server(["good"]))
    assert r.error is None and r.error_type is None
    assert r.output_tokens == 5 and len(r.token_times_s) == 5
    assert r.prompt_tokens == 42 and r.cache_hits == {"prefix": (16, 42)}
    assert r.start_s < r.first_token_s == r.token_times_s[0] <= r.end_s
    assert r.ttft_s >= 0.045  # role chunk arrived earlier but is not a token
    # Loose bounds: a busy 2-core box may coalesce two chunks into one read.
    gaps = r.itls_s
    assert len(gaps) == 4 and all(g >= 0 for g in gaps)
    assert r.token_times_s[-1] - r.token_times_s[0] >= 0.05
    assert r.tpot_s is not None and r.tpot_s >= 0.01

    req = REQ
    sent = seen[0]
    assert sent["request_line"] == "POST /v1/chat/completions HTTP/1.1"
    assert sent["headers"]["authorization"] == "Bearer k"
    body = sent["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True
    parts = body["messages"][0]["content"]
    mime = "image/png" if req.images()[0].startswith(b"\x89PNG") else "image/jpeg"
    assert parts[0]["type"] == "image_url" and parts[0]["image_url"]["url"].startswith(f"data:{mime};base64,")
    assert base64.b64decode(parts[0]["image_url"]["url"].split(",", 1)[1]) == req.images()[0]
    assert parts[1]["type"] == "text"


def test_errors_become_records() -> None:
    recs, _ = asyncio.run(_with_server(["bad", "malformed", "truncated"]))
    bad, malformed, truncated = recs
    assert bad.error_type == "HTTPError" and "400" in bad.error and "model not found" in bad.error
    assert malformed.error_type == "MalformedSSE"
    assert truncated.error_type == "IncompleteStream" and len(truncated.token_times_s) == 5


def test_connection_refused_is_a_record() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use, so nothing listens
    req = make_trace("text", 1, seed=0)[0]
    r = asyncio.run(run_request(None, f"http://127.0.0.1:{port}/v1", "m", req))
    assert r.error_type == "ConnectionRefusedError" and r.end_s is not None
    r = asyncio.run(run_request(HttpOptions(timeout_s=5), "ftp://x/v1", "m", req))
    assert r.error_type == "BadURL"


def test_multiturn_history_payload() -> None:
    trace = make_trace("multiturn", 3, seed=1, image_share=1.0, resolutions=[((32, 32), 1.0)])
    later = next(r for r in trace if r.turn > 0)
    msgs = build_payload("m", later)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * later.turn + ["user"]
    assert isinstance(msgs[1]["content"], str)
    assert msgs[0]["content"][0]["type"] == "image_url"


def test_http_target_fills_the_serve_record_through_run_trace() -> None:
    """HttpTarget behind the Target interface: the same record run_request gives, in the record serve made."""
    from mserve.bench.http_target import HttpTarget
    from mserve.bench.serve import record_class, run_trace
    from mserve.bench.targets import Target

    async def go() -> tuple[list, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        server = await asyncio.start_server(lambda r, w: _handle(r, w, seen), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = HttpTarget(f"http://127.0.0.1:{port}/v1/", "good", ignore_eos=True, timeout_s=30)
        assert isinstance(target, Target) and target.prepare(REQ) is None
        async with server:
            records, _ = await run_trace(target, [REQ], progress_label=None)
        return records, seen

    (r,), seen = asyncio.run(go())
    assert type(r) is record_class() and r.request_id == REQ.request_id and r.modality == REQ.modality
    assert r.ok and r.output_tokens == 5 and len(r.token_times_s) == 5 and r.prompt_tokens == 42
    assert r.start_s < r.first_token_s == r.token_times_s[0] <= r.end_s and r.scheduled_s <= r.start_s
    assert r.cache_hits == {"prefix": (16, 42)}
    assert seen[0]["request_line"] == "POST /v1/chat/completions HTTP/1.1"
    assert seen[0]["body"]["ignore_eos"] is True and "authorization" not in seen[0]["headers"]
