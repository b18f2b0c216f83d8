"""Stdlib asyncio client that replays one TraceRequest against an OpenAI-compatible streaming chat server.

``run_request`` sends one request and returns its record; ``HttpTarget`` is the same behind the
bench Target interface (mserve.bench.targets) that `mserve bench serve` drives.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from mserve.bench.metrics import RequestRecord
from mserve.bench.targets import Target
from mserve.bench.traces import TraceRequest

# aiohttp is not a project dependency, so HTTP/1.1 is spoken by hand over asyncio streams.


@dataclass
class HttpOptions:
    """Per-target settings; pass as `session_or_conn` (None means defaults).

    extra_body is merged into every payload, e.g. {"ignore_eos": True} so a vLLM
    peer always generates max_tokens, matching a cluster run of the same trace.
    """

    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 6 * 3600.0  # vLLM's bench default; long runs at overload are legitimate
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_error_body: int = 4096
    # Send each request's priority and latency_class in the body (MServe's gateway reads both; vLLM takes
    # priority only with --scheduling-policy priority, so peers get neither unless asked).
    send_classes: bool = False


class StreamError(Exception):
    """A response that is not a well-formed stream; error_type names what went wrong."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def _mime(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"GIF8"):
        return "image/gif"
    return "image/jpeg"


def image_data_url(data: bytes) -> str:
    return f"data:{_mime(data)};base64,{base64.b64encode(data).decode('ascii')}"


def to_openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trace messages -> OpenAI chat messages (images become image_url data URLs; a video's frames a
    ``{"type": "video", "video": [data URLs]}`` part, as MServe's gateway takes it; a video file a video_url;
    a document OpenAI's ``file`` part; an audio clip OpenAI's ``input_audio`` part)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(dict(msg))
            continue
        if msg.get("role") != "user" and all(p.get("type") == "text" for p in content):
            # Some chat templates reject list content for assistant/system turns.
            out.append({"role": msg["role"], "content": "".join(p["text"] for p in content)})
            continue
        parts = []
        for part in content:
            if part.get("type") == "image":
                parts.append({"type": "image_url", "image_url": {"url": image_data_url(part["image"])}})
            elif part.get("type") == "video" and isinstance(part.get("video"), list):  # frames, as MServe's gateway takes them
                parts.append({"type": "video", "video": [image_data_url(f) for f in part["video"]]})
            elif part.get("type") == "video":  # a video file
                url = f"data:video/mp4;base64,{base64.b64encode(part['video']).decode('ascii')}"
                parts.append({"type": "video_url", "video_url": {"url": url}})
            elif part.get("type") == "audio":  # a clip, as OpenAI's input_audio part
                data = base64.b64encode(part["audio"]).decode("ascii")
                parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
            elif part.get("type") == "document":  # a PDF, as OpenAI's file part
                data = base64.b64encode(part["document"]).decode("ascii")
                parts.append({"type": "file", "file": {"filename": "document.pdf",
                                                       "file_data": f"data:application/pdf;base64,{data}"}})
            else:
                parts.append(part)
        out.append({"role": msg["role"], "content": parts})
    return out


def build_payload(model: str, req: TraceRequest, extra_body: dict[str, Any] | None = None, *,
                  classes: bool = False) -> dict[str, Any]:
    """The chat completion body; with `classes`, the request's priority and latency_class too."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": to_openai_messages(req.messages),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if classes:
        payload.update(priority=req.priority, latency_class=req.latency_class)
    payload.update(extra_body or {})
    return payload


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise StreamError("EmptyResponse", "server closed the connection without a response")
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise StreamError("BadResponse", f"bad status line {status_line[:100]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """Raw body bytes as they arrive, for chunked, sized and close-delimited responses."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise StreamError("IncompleteStream", "connection closed inside chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return  # trailers (if any) are irrelevant; the connection is closed anyway
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                raise StreamError("IncompleteStream", "connection closed before content-length bytes")
            remaining -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def _sse_events(body: AsyncIterator[bytes]) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) per server-sent event; the time is taken when its bytes arrived."""
    buf = b""
    data_lines: list[str] = []
    async for chunk in body:
        now = time.perf_counter()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if data_lines:
                    yield now, "\n".join(data_lines)
                    data_lines = []
            elif line.startswith("data:"):
                value = line[5:]
                data_lines.append(value[1:] if value.startswith(" ") else value)
            # comments (":...") and event:/id:/retry: fields carry nothing we measure
    tail = buf.rstrip(b"\r").decode("utf-8", errors="replace")
    if tail.startswith("data:"):
        data_lines.append(tail[5:].lstrip(" "))
    if data_lines:
        yield time.perf_counter(), "\n".join(data_lines)


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
    except ValueError:
        pass
    return text.strip()


async def _exchange(base_url: str, opts: HttpOptions, body: bytes, rec: RequestRecord) -> None:
    url = urlsplit(base_url)
    if url.scheme not in ("http", "https"):
        raise StreamError("BadURL", f"unsupported URL scheme in {base_url!r}")
    tls = url.scheme == "https"
    host, port = url.hostname or "localhost", url.port or (443 if tls else 80)
    path = url.path.rstrip("/") + "/chat/completions"
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {url.netloc}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        # One connection per request: no pool to go stale, and connect cost on a LAN is << TTFT.
        "Connection: close",
    ]
    if opts.api_key:
        head.append(f"Authorization: Bearer {opts.api_key}")
    head += [f"{k}: {v}" for k, v in opts.headers.items()]

    reader, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context() if tls else None)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status, headers = await _read_headers(reader)
        if status >= 400:
            err = b""
            async for chunk in _body(reader, headers):
                err += chunk
                if len(err) >= opts.max_error_body:
                    break
            raise StreamError("HTTPError", f"HTTP {status}: {_error_message(err[: opts.max_error_body])}")
        await _consume_stream(_sse_events(_body(reader, headers)), rec)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass  # the peer may already be gone; nothing left to measure


async def _consume_stream(events: AsyncIterator[tuple[float, str]], rec: RequestRecord) -> None:
    done = False
    chunks = 0
    usage: dict[str, Any] | None = None
    async for ts, data in events:
        if data.strip() == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise StreamError("MalformedSSE", f"bad JSON in SSE data: {data[:200]!r}") from exc
        if not isinstance(obj, dict):
            raise StreamError("MalformedSSE", f"SSE data is not an object: {data[:200]!r}")
        if obj.get("error"):
            err = obj["error"]
            raise StreamError("ServerError", str(err.get("message", err) if isinstance(err, dict) else err))
        rec.end_s = ts  # like vLLM: end-to-end ends at the last data event, not at [DONE]
        if isinstance(obj.get("model"), str):
            rec.served_model = obj["model"]  # the model that answered: a group's variant, not the name asked for
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            # Reasoning models stream thinking tokens separately; they are still generated tokens. A chunk
            # with token_ids (vLLM's return_token_ids, bench/hf_server.py) is a token even when its text is
            # empty (a special token, or a byte held back until its UTF-8 character completes).
            if (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or choice.get("token_ids")):
                if rec.first_token_s is None:
                    rec.first_token_s = ts
                rec.token_times_s.append(ts)
                chunks += 1
                break
        if obj.get("usage"):
            usage = obj["usage"]
    rec.output_tokens = chunks
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.output_tokens = int(usage.get("completion_tokens") or chunks)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            rec.cache_hits["prefix"] = (int(cached), rec.prompt_tokens)
    if not done:
        raise StreamError("IncompleteStream", "stream ended without data: [DONE]")


async def run_request(
    session_or_conn: HttpOptions | None, base_url: str, model: str, req: TraceRequest
) -> RequestRecord:
    """POST one streaming chat completion to `{base_url}/chat/completions` and time every token.

    Never raises (except on cancellation): HTTP/connection/stream failures come
    back as a record with error and error_type set, keeping any partial timings.
    Without `usage` in the stream, output_tokens is the number of content chunks.
    """
    rec = RequestRecord(
        request_id=req.request_id, modality=req.modality, priority=req.priority, latency_class=req.latency_class
    )
    await record_request(session_or_conn or HttpOptions(), base_url, model, req, rec)
    return rec


async def record_request(opts: HttpOptions, base_url: str, model: str, req: TraceRequest, rec: RequestRecord) -> None:
    """run_request into a record the caller made (e.g. a subclass with more fields); never raises either."""
    try:
        # Encoding happens before start_s, as in vLLM, so base64 of big images is not billed to TTFT.
        body = json.dumps(build_payload(model, req, opts.extra_body, classes=opts.send_classes)).encode()
    except (TypeError, ValueError) as exc:
        rec.error, rec.error_type = f"cannot encode request: {exc}", "BadRequest"
        return
    rec.start_s = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(base_url, opts, body, rec), timeout=opts.timeout_s)
    except StreamError as exc:
        rec.error, rec.error_type = str(exc), exc.error_type
    except asyncio.TimeoutError:
        rec.error, rec.error_type = f"no complete response within {opts.timeout_s:g} s", "Timeout"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        rec.error, rec.error_type = str(exc) or repr(exc), type(exc).__name__
    except Exception as exc:  # a benchmark must record, not crash on, one odd response
        rec.error, rec.error_type = repr(exc), type(exc).__name__
    if rec.end_s is None:
        rec.end_s = time.perf_counter()


class HttpTarget(Target):
    """An OpenAI-compatible streaming chat server as a bench Target: one connection per request.

    open/close/prepare are Target's no-ops: the JSON body is built in ``run``, before ``start_s``
    (as in vLLM), so a whole trace's base64 bodies are never held at once.
    """

    def __init__(self, base_url: str, model: str, *, ignore_eos: bool, timeout_s: float,
                 send_classes: bool = False) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.opts = HttpOptions(timeout_s=timeout_s, extra_body={"ignore_eos": True} if ignore_eos else {},
                                send_classes=send_classes)

    async def run(self, req: TraceRequest, prepared: None, rec: RequestRecord) -> None:
        await record_request(self.opts, self.base_url, self.model, req, rec)
