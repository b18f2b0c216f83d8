"""OpenAI chat-completions requests in, MServe GENERATE arguments out; errors in OpenAI's shapes (the
responses' are gateway/openai_responses.py).

Pure code (no sockets, no event loop; http(s) media URLs go to the fetcher it is handed,
gateway/media_fetch.py) so every rule here is unit-tested on its own. What the
engine supports passes through; what it does not is refused with a 400 that names the field,
unless the client sent that field at its neutral value (``n: 1``, ``presence_penalty: 0``: SDKs
and frameworks send these by default, and honouring them costs nothing).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mserve.common import sampling_rules as rules
from mserve.common.documents import PDF_MIME, DocumentError, DocumentLimits, render_pdf
from mserve.common.policy import LATENCY_CLASSES
from mserve.common.prompt import CHAT_ROLES
from mserve.common.protocol import ErrorCode
from mserve.gateway.media_fetch import MediaFetcher
from mserve.gateway.media_rules import MediaRefused

__all__ = ["ApiError", "ChatRequest", "parse_chat_request", "has_documents", "error_body", "status_for_code"]

MAX_STOP_SEQUENCES = 4  # as OpenAI

# Fields OpenAI defines that this server cannot honour, with the value that means "not used".
_NEUTRAL: dict[str, Any] = {
    "n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": None,
    "logit_bias": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
    "response_format": None, "parallel_tool_calls": None, "audio": None, "modalities": None,
    "prediction": None, "reasoning_effort": None, "web_search_options": None, "service_tier": None,
    "store": None, "metadata": None,
}
# Accepted and ignored: they describe the caller, not the generation.
_IGNORED = {"user", "safety_identifier", "prompt_cache_key"}
_SUPPORTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
              "stop", "stream", "stream_options",
              # extensions (vLLM spells the first four the same way)
              "top_k", "ignore_eos", "stop_token_ids", "priority", "latency_class", "return_token_ids"}


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# MServe error code -> (HTTP status, OpenAI error type)
_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.BAD_MESSAGE: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.NO_WORKERS: (503, "service_unavailable_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.ABORTED: (499, "aborted"),
    ErrorCode.LOST: (503, "service_unavailable_error"),  # the coordinator restarted mid-request: retry
    ErrorCode.INTERNAL: (500, "server_error"),
    # The coordinator refused the gateway's own key (--coordinator-api-key): a gateway misconfiguration,
    # not the HTTP client's fault; the message says which setting to fix.
    ErrorCode.UNAUTHORIZED: (502, "server_error"),
}


def status_for_code(code: str) -> tuple[int, str]:
    return _STATUS.get(code, (500, "server_error"))


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class ChatRequest:
    """A validated chat completion request, ready for ``AsyncClient.stream(messages, **sampling)``."""

    model: str
    messages: list[dict[str, Any]]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    return_token_ids: bool = False


def _number(body: dict[str, Any], name: str, kind: type, rule: str | None = None) -> Any:
    """body[name] as `kind` (None when absent), within common/sampling_rules.py's bound for `rule`."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _bad(name, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    bound = rules.BOUNDS[rule] if rule else None
    if bound is not None and not bound.ok(value):
        raise _bad(name, f"'{name}' must be {bound.describe()}, got {value!r}")
    return kind(value)


def parse_chat_request(body: Any, *, media_root: Path | None = None, default_max_tokens: int = rules.MAX_TOKENS,
                       fetcher: MediaFetcher | None = None, documents: DocumentLimits = DocumentLimits()) -> ChatRequest:
    """Validate an OpenAI chat completion body; ApiError(400) names the first field that is wrong.
    With a ``fetcher`` http(s) media URLs are fetched, and a PDF `file` part is rendered here: both slow,
    so the gateway calls this in a thread for such bodies (has_documents, app.py)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in _SUPPORTED or name in _IGNORED:
            continue
        if name in _NEUTRAL:
            if value == _NEUTRAL[name] or (value is None):
                continue
            raise _bad(name, f"'{name}' is not supported by this server (only {_NEUTRAL[name]!r} or omitted)")
        raise _bad(name, f"unrecognized request argument '{name}'")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required and must be a string")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be a boolean")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "'stream_options' supports only include_usage")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = bool(opts.get("include_usage", False))
    max_new = _number(body, "max_completion_tokens", int, "max_tokens")
    if max_new is None:
        max_new = _number(body, "max_tokens", int, "max_tokens")
    sampling: dict[str, Any] = {"max_tokens": default_max_tokens if max_new is None else max_new}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = _number(body, name, kind, name)
        if value is not None:
            sampling[name] = value
    if body.get("seed") is not None:
        sampling["seed"] = _number(body, "seed", int)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise _bad("ignore_eos", "'ignore_eos' must be a boolean")
        sampling["ignore_eos"] = body["ignore_eos"]
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", "'stop_token_ids' must be a list of token ids")
        sampling["stop_token_ids"] = ids
    if body.get("priority") is not None:
        sampling["priority"] = _number(body, "priority", int, "priority")
    if body.get("latency_class") is not None:
        if body["latency_class"] not in LATENCY_CLASSES:
            raise _bad("latency_class", f"'latency_class' must be one of {', '.join(LATENCY_CLASSES)}")
        sampling["latency_class"] = body["latency_class"]
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_SEQUENCES:
        raise _bad("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} of them")
    return_ids = body.get("return_token_ids") or False
    if not isinstance(return_ids, bool):
        raise _bad("return_token_ids", "'return_token_ids' must be a boolean")
    messages = convert_messages(body.get("messages"), media_root, fetcher, documents)
    return ChatRequest(model, messages, sampling, stream, include_usage, list(stops), return_ids)


def convert_messages(messages: Any, media_root: Path | None, fetcher: MediaFetcher | None = None,
                     documents: DocumentLimits = DocumentLimits()) -> list[dict[str, Any]]:
    """OpenAI messages -> MServe messages (images, video files and video frames as bytes, a PDF as its
    pages' images); the chat
    template sees the turns as sent. Not the server's normalize_messages: this one reads files under the
    media root only and names the wrong field OpenAI's way (common/prompt.py says why the walks stay apart)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(where, f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role == "developer":  # OpenAI's newer name for the system turn
            role = "system"
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"{where}.role {role!r} is not supported (system, developer, user, assistant)")
        if msg.get("tool_calls") or msg.get("function_call"):
            raise _bad(f"{where}.tool_calls", "tool calls are not supported by this server")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise _bad(f"{where}.content", f"{where}.content must be a string or a non-empty list of parts")
        parts = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{pwhere}.text", f"{pwhere}.text must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise _bad(f"{pwhere}.image_url", f"{pwhere}.image_url.url must be a string")
                parts.append({"type": "image", "image": load_media_url(url, kind="image", media_root=media_root,
                                                                       param=f"{pwhere}.image_url", fetcher=fetcher)})
            elif kind == "video_url":  # a video file, as vLLM takes it
                url = part.get("video_url")
                if isinstance(url, dict) and url.get("fps") is not None:
                    raise _bad(f"{pwhere}.video_url.fps", "a video file's rate is read from the file: fps is for "
                               "a video given as its frames ({\"type\": \"video\", \"video\": [...], \"fps\": ...})")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise _bad(f"{pwhere}.video_url", f"{pwhere}.video_url.url must be a string")
                parts.append({"type": "video", "video": load_media_url(url, kind="video", media_root=media_root,
                                                                       param=f"{pwhere}.video_url", fetcher=fetcher)})
            elif kind == "video":  # the video as its frames: a list of image URLs
                frames = part.get("video")
                if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
                    raise _bad(f"{pwhere}.video", f"{pwhere}.video must be a non-empty list of image URLs (the frames)")
                fps = part.get("fps")  # optional: the rate the frames were taken at (Qwen2.5-VL / Qwen3-VL use it)
                if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e4):
                    raise _bad(f"{pwhere}.fps", f"{pwhere}.fps must be a number of frames per second over 0")
                parts.append({"type": "video", "video": [load_media_url(f, kind="image", media_root=media_root,
                                                                        param=f"{pwhere}.video[{k}]", fetcher=fetcher)
                                                         for k, f in enumerate(frames)],
                              **({"fps": float(fps)} if fps is not None else {})})
            elif kind == "file":  # a PDF, as OpenAI takes it: its pages become image parts, in order
                parts.extend({"type": "image", "image": page} for page in load_file_part(part, pwhere, documents))
            elif kind in ("input_audio", "audio_url"):  # OpenAI's audio part, and vLLM's
                parts.append({"type": "audio", "audio": load_audio_part(part, kind, media_root, pwhere, fetcher)})
            else:
                raise _bad(f"{pwhere}.type", f"{pwhere}.type {kind!r} is not supported (text, image_url, video_url, "
                                             "video, file, input_audio, audio_url)")
        out.append({"role": role, "content": parts})
    return out


def load_audio_part(part: dict[str, Any], kind: str, media_root: Path | None, pwhere: str,
                    fetcher: MediaFetcher | None = None) -> bytes:
    """An audio clip's bytes: OpenAI's input_audio {"data": base64, "format": ...} (AUDIO_FORMATS), or
    vLLM's audio_url {"url": ...}, read as every media URL is (load_media_url)."""
    from mserve.common.audio import AUDIO_FORMATS

    body = part.get(kind)
    if kind == "audio_url":
        url = body.get("url") if isinstance(body, dict) else body
        if not isinstance(url, str) or not url:
            raise _bad(f"{pwhere}.audio_url", f"{pwhere}.audio_url.url must be a string")
        return load_media_url(url, kind="audio", media_root=media_root, param=f"{pwhere}.audio_url",
                              fetcher=fetcher)
    if not isinstance(body, dict) or not isinstance(body.get("data"), str) or not body["data"]:
        raise _bad(f"{pwhere}.input_audio.data", f"{pwhere}.input_audio.data must be the clip as a base64 string")
    if body.get("format") not in AUDIO_FORMATS:
        raise _bad(f"{pwhere}.input_audio.format", f"{pwhere}.input_audio.format must be one of "
                                                    f"{', '.join(AUDIO_FORMATS)} (got {body.get('format')!r})")
    try:
        return base64.b64decode(body["data"], validate=True)
    except ValueError:
        raise _bad(f"{pwhere}.input_audio.data", f"{pwhere}.input_audio.data is not valid base64") from None


def load_file_part(part: dict[str, Any], where: str, limits: DocumentLimits) -> list[bytes]:
    """A `file` part's PDF (``file.file_data``: a base64 data URL) -> its pages as PNG bytes, in order
    (common/documents.py: resolution, limits). Uploaded files (``file_id``) are not kept by this server."""
    f = part.get("file")
    if not isinstance(f, dict):
        raise _bad(f"{where}.file", f"{where}.file must be an object with file_data (a base64 data URL of a PDF)")
    data = f.get("file_data")
    if data is None and f.get("file_id") is not None:
        raise _bad(f"{where}.file.file_id", f"{where}.file.file_id: uploaded files are not supported by this "
                                            f"server; send the document inline as file.file_data "
                                            f"(data:{PDF_MIME};base64,...)")
    param = f"{where}.file.file_data"
    if not isinstance(data, str) or not data.startswith("data:"):
        raise _bad(param, f"{param} must be a base64 data URL (data:{PDF_MIME};base64,...)")
    head, _, b64 = data.partition(",")
    mime = head[len("data:"):].partition(";")[0]
    if not head.endswith(";base64") or not b64:
        raise _bad(param, f"{param}: data URLs must be base64 (data:{PDF_MIME};base64,...)")
    if mime != PDF_MIME:
        raise _bad(param, f"{param}: documents of type {mime!r} are not supported (only {PDF_MIME})")
    if len(b64) // 4 * 3 > limits.max_bytes + 2:  # refused before decoding
        raise _bad(param, f"{param}: the document is about {len(b64) // 4 * 3} bytes, over the limit "
                          f"max_document_bytes={limits.max_bytes}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise _bad(param, f"{param}: the data URL is not valid base64") from None
    try:
        return render_pdf(raw, limits, param)
    except DocumentError as exc:
        raise _bad(param, str(exc)) from None


def has_documents(body: Any) -> bool:
    """Whether a request body carries a `file` part: its parse renders pages, which the gateway runs off its
    event loop."""
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "file" for p in m["content"]) for m in messages)


def load_image_url(url: str, media_root: Path | None, param: str, fetcher: MediaFetcher | None = None) -> bytes:
    """An image part's URL: load_media_url with kind="image"."""
    return load_media_url(url, kind="image", media_root=media_root, param=param, fetcher=fetcher)


def load_media_url(url: str, *, kind: str, media_root: Path | None, param: str,
                   fetcher: MediaFetcher | None = None) -> bytes:
    """A media part's bytes, for every kind (image, video, audio, file): a data URL; an ``http(s)://`` URL
    through ``fetcher`` (gateway/media_fetch.py: its rules, refusals named in a 400), refused without one;
    or a local file (``file://`` or a path) under ``media_root``."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64") or not data:
            raise _bad(param, f"{param}: data URLs must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise _bad(param, f"{param}: the data URL is not valid base64") from None
    if url[:8].lower().startswith(("http://", "https://")):
        if fetcher is None:
            raise _bad(param, f"{param}: remote media URLs are not fetched here; send the {kind} as a base64 data URL")
        try:
            return fetcher.fetch(url, kind)
        except MediaRefused as exc:
            raise ApiError(exc.status, f"{param}: {exc.message}", param=param,
                           type_="rate_limit_error" if exc.status == 429 else "invalid_request_error",
                           retry_after_s=exc.retry_after_s) from None
    if media_root is None:
        raise _bad(param, f"{param}: local image paths are refused (the gateway was started without "
                          "--allowed-media-path); send the image as a base64 data URL")
    raw = url[len("file://"):] if url.startswith("file://") else url
    path = Path(raw)
    if not path.is_absolute():
        path = media_root / path
    path = path.resolve()
    if not path.is_relative_to(media_root):
        raise _bad(param, f"{param}: {raw!r} is outside the allowed media path {str(media_root)!r}")
    if not path.is_file():
        raise _bad(param, f"{param}: no such file {raw!r} under the allowed media path")
    return path.read_bytes()
