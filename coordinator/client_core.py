"""What the sync and async clients share: results, request building and reply assembly (and, re-exported,
the errors of coordinator/client_errors.py).

``client.py`` (``Client``, ``TokenStream``) and ``async_client.py`` (``AsyncClient``,
``AsyncTokenStream``) both build on this module (and on ``client_request.py``, the sans-IO per-request
core they run as I/O loops around, and ``client_shards.py``, which picks a coordinator shard) and on
nothing of each other's. Messages are the typed client-link classes of
``common/protocol/client.py``; every reply is parsed once, in ``recv_valid``. It imports no torch
(serde loads it only when a tensor is decoded, and client replies carry none).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Sequence, Union

import zmq

from mserve.common.audio import audio_part_from_content
from mserve.common.documents import MAX_DOCUMENT_PAGES, DocumentError, DocumentLimits, render_pdf, render_pdf_file
from mserve.common.prompt import image_bytes_from_part
from mserve.common.video import video_part_from_value
from mserve.common.protocol import MsgType, ProtocolError, parse_message
from mserve.common.protocol.client import (TO_CLIENT, Abort, Error, Generate, Result, Sampling, Status, StatusReply,
                                          Tokens)
from mserve.common.serde import WireError
from mserve.common.sockets import recv, send
from mserve.coordinator.client_errors import (Aborted, BadRequest, Lost, ModelNotFound, MServeError, NoWorkers,
                                              Overloaded, RequestTimeout, ServerError, Unauthorized, error_from_reply,
                                              lost_reply, shard_gone_reply)
from mserve.coordinator.client_shards import SHARD_PROBES_UNANSWERED, ShardChooser

# One logger for both flavours: what a client logs reads the same whichever was used.
logger = logging.getLogger("mserve.coordinator.client")

__all__ = [
    "MServeError", "BadRequest", "Overloaded", "NoWorkers", "ModelNotFound", "RequestTimeout", "Aborted", "ServerError", "Lost",
    "PROBE_AFTER_S", "probe_body", "lost_reply", "shard_gone_reply", "ShardChooser", "SHARD_PROBES_UNANSWERED",
    "GenerateResult", "normalize_client_messages", "error_from_reply", "generate_body", "new_request_id",
    "new_identity", "Assembler", "StreamState", "send_abort", "recv_valid",
    "Unauthorized", "client_api_key", "Reply", "status_body",
]


# --------------------------------------------------------------------------- results

# A request silent this long makes the client ask the coordinator whether it still holds it (a
# coordinator that restarted does not), so no request waits out its whole timeout for nothing.
PROBE_AFTER_S = 5.0


def probe_body(request_ids: list[str]) -> dict[str, Any]:
    """STATUS asking which of these requests the coordinator still holds (answered with unknown_requests)."""
    return Status(request_ids=list(request_ids)).to_body()


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    visual_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, encode_s, ..., total_s
    cache_hits: dict[str, int] = field(default_factory=dict)  # embedding, prefix_tokens
    attempts: int = 1
    visual_keep_ratio: float | None = None  # set when SLO-adaptive pruning pruned this request's images
    model: str | None = None  # the served model that answered (a group's variant); None: an older coordinator

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> GenerateResult:
        return cls.from_reply(Result.from_body(body))

    @classmethod
    def from_reply(cls, r: Result) -> GenerateResult:
        return cls(request_id=r.request_id, token_ids=r.token_ids, text=r.text, finish_reason=r.finish_reason,
                   prompt_tokens=r.prompt_tokens, visual_tokens=r.visual_tokens, timings=r.timings,
                   cache_hits=r.cache_hits, attempts=r.attempts, visual_keep_ratio=r.visual_keep_ratio,
                   model=r.model)


# --------------------------------------------------------------------------- request building


def normalize_client_messages(messages: Sequence[dict[str, Any]],
                              documents: DocumentLimits = DocumentLimits()) -> list[dict[str, Any]]:
    """OpenAI-shaped messages with every image part turned into ``{"type": "image", "image": bytes}``, and
    every video part into ``{"type": "video", "video": [frame bytes, ...] or video file bytes}``, and every
    document part (``{"type": "document", "document": PDF bytes or a path}``) into its pages' image parts,
    and every audio part (``audio``: bytes, a path or a data URL; OpenAI's ``input_audio``; vLLM's ``audio_url``) into
    ``{"type": "audio", "audio": bytes}``.

    Image parts may hold bytes, a file path (str or Path), a data URL, or be OpenAI's
    ``{"type": "image_url", "image_url": {"url": ...}}``. The server refuses paths (they name files on
    the client's disk), so they are read here. The input is not modified. Roles and text are left to
    the server's normalize_messages (common/prompt.py says why the two walks stay apart).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        content = msg.get("content")
        if isinstance(content, str):
            out.append(dict(msg))
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(dict(part))
            elif kind in ("image", "audio", "video") and "media" in part:  # in a media store: its ref (common/media_store.py)
                parts.append({"type": kind, "media": dict(part["media"])})
            elif kind in ("image", "image_url"):
                if isinstance(part.get("image"), PurePath):  # image_bytes_from_part takes str paths
                    part = {**part, "image": str(part["image"])}
                try:
                    parts.append({"type": "image", "image": image_bytes_from_part(part)})
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].content[{j}]: {exc}") from None
            elif kind in ("audio", "input_audio", "audio_url"):  # a clip: bytes, a path, a data URL, OpenAI's, vLLM's
                if isinstance(part.get("audio"), PurePath):
                    part = {**part, "audio": str(part["audio"])}
                try:
                    parts.append({"type": "audio", "audio": audio_part_from_content(part).data})
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].content[{j}]: {exc}") from None
            elif kind == "video":  # a list of frames, or one video file; paths are read here too
                try:
                    video = video_part_from_value(part.get("video"), fps=part.get("fps"))
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].content[{j}]: {exc}") from None
                parts.append({"type": "video", "video": list(video.frames) if video.frames is not None else video.data,
                              **({"fps": video.fps} if video.fps is not None else {})})
            elif kind == "document":  # a PDF (bytes or a path): its pages, as the gateway renders a `file` part
                parts.extend({"type": "image", "image": page} for page in _document_pages(part, f"messages[{i}].content[{j}]", documents))
            else:
                raise ValueError(f"messages[{i}].content[{j}] has an unsupported part type {kind!r} "
                                 "(expected 'text', 'image', 'image_url', 'video', 'document', 'audio', 'input_audio' or 'audio_url')")
        out.append({**msg, "content": parts})
    return out


def _document_pages(part: dict[str, Any], where: str, limits: DocumentLimits) -> list[bytes]:
    """A ``{"type": "document", "document": bytes | path}`` part's pages (common/documents.py). The client
    knows no model's image processor, so pages render at ``limits.dpi`` (96 by default), not at the model's
    pixel budget as the gateway renders them: send a page rendered for the model as an image part to share
    the gateway's cache entries."""
    value, field = part.get("document"), f"{where}.document"
    try:
        if isinstance(value, (str, PurePath)):
            return render_pdf_file(value, limits, field)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise DocumentError(f"{field} holds PDF bytes or a path (got {type(value).__name__})")
        return render_pdf(bytes(value), limits, field)
    except DocumentError as exc:
        raise ValueError(str(exc)) from None


def generate_body(request_id: str, messages: Sequence[dict[str, Any]], stream: bool, *,
                  max_tokens: int = Sampling.max_tokens, temperature: float = Sampling.temperature,
                  top_k: int = Sampling.top_k, top_p: float = Sampling.top_p, seed: int | None = Sampling.seed,
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = Sampling.ignore_eos, priority: int = Generate.priority,
                  latency_class: str = "interactive", trace: str | None = None,
                  model: str | None = None, max_document_pages: int = MAX_DOCUMENT_PAGES) -> dict[str, Any]:
    """The GENERATE body; the keyword arguments are the ``**sampling`` options of generate()/stream().
    `max_document_pages`: the most pages a document part may have (its pages are sent, not this).
    `trace`: the caller's span as a W3C traceparent, which the request's trace continues under.
    `model`: the served model name (None: the coordinator's default, or the only model it serves)."""
    sampling = Sampling(max_tokens=int(max_tokens), temperature=float(temperature), top_k=int(top_k),
                        top_p=float(top_p), seed=None if seed is None else int(seed),
                        stop_token_ids=[int(t) for t in stop_token_ids], ignore_eos=bool(ignore_eos))
    return Generate(request_id=request_id, messages=normalize_client_messages(
                        messages, DocumentLimits(max_pages=int(max_document_pages))), sampling=sampling,
                    priority=int(priority), latency_class=latency_class, stream=stream, trace=trace,
                    model=model).to_body()


def status_body() -> dict[str, Any]:
    """STATUS asking for the coordinator's status (workers, roles, model, ...)."""
    return Status().to_body()


def client_api_key(api_key: str | None) -> str | None:
    """The key a client sends in every message: ``api_key``, else $MSERVE_CLIENT_API_KEY, else None."""
    key = api_key if api_key is not None else os.environ.get("MSERVE_CLIENT_API_KEY")
    return key or None


def new_request_id(request_id: str | None) -> str:
    """The caller's id, or a fresh random one."""
    return request_id if request_id is not None else uuid.uuid4().hex


def new_identity() -> bytes:
    """A DEALER identity for one client."""
    return b"client-" + uuid.uuid4().hex[:16].encode()


# --------------------------------------------------------------------------- replies

Reply = Union[Tokens, Result, Error, StatusReply]  # what a client receives (common/protocol/client.py)



class Assembler:
    """Folds one request's TOKENS / RESULT / ERROR replies into tokens ready to hand out.

    ``reorder``: tokens arrive on two paths (the coordinator's, and a decode worker's straight to this
    client's token sink) and may overtake each other; a chunk ahead of the next index waits until the
    gap fills (RESULT, which carries every token, fills any that remains). Without it a gap is an error.
    Either way a token already received is never handed out twice, and a RESULT that disagrees with
    what was streamed fails loudly."""

    def __init__(self, request_id: str, reorder: bool = False) -> None:
        self.request_id = request_id
        self.reorder = reorder
        self.ready: deque[int] = deque()
        self.received: list[int] = []
        self.num_received = 0
        self._early: dict[int, list[int]] = {}  # chunks ahead of num_received, by index (reorder)
        self.result: GenerateResult | None = None
        self.finished = False  # the server ended the request (RESULT or ERROR)
        self.prompt_tokens: int | None = None  # from the first TOKENS (streams) or RESULT
        self.model: str | None = None  # the served model answering: from the first TOKENS or RESULT

    def feed(self, kind: int, reply: Reply | dict[str, Any]) -> None:
        if isinstance(reply, dict):  # a body not parsed at a socket (tests, tools)
            reply = TO_CLIENT[MsgType(kind)].from_body(reply)
        if isinstance(reply, Error):
            self.finished = True
            raise error_from_reply(Error(request_id=reply.request_id or self.request_id, code=reply.code,
                                         message=reply.message, retry_after_s=reply.retry_after_s))
        if isinstance(reply, Tokens):
            index, tokens = reply.index, reply.token_ids
            if reply.prompt_tokens is not None:
                self.prompt_tokens = reply.prompt_tokens
            if reply.model is not None:
                self.model = reply.model
            if index > self.num_received:
                if not self.reorder:
                    # A gap means tokens were lost; the output would be silently wrong, so fail loudly.
                    raise ServerError(f"token stream gap: expected index {self.num_received}, got {index}",
                                      request_id=self.request_id)
                if len(tokens) > len(self._early.get(index, ())):
                    self._early[index] = tokens
                return
            self._take(index, tokens)
            while early := [i for i in self._early if i <= self.num_received]:
                for i in sorted(early):
                    self._take(i, self._early.pop(i))
        elif isinstance(reply, Result):
            self.result = GenerateResult.from_reply(reply)
            self.prompt_tokens = self.result.prompt_tokens
            self.model = self.result.model or self.model
            if self.result.token_ids[:self.num_received] != self.received:
                self.finished = True
                raise ServerError("the streamed tokens differ from the result's", request_id=self.request_id)
            # RESULT carries the whole output: hand out any tail that no TOKENS chunk carried.
            self._early.clear()
            self._take(0, self.result.token_ids)
            self.finished = True

    def _take(self, index: int, tokens: list[int]) -> None:
        fresh = tokens[self.num_received - index:]  # a retried attempt may resend tokens we have
        self.ready.extend(fresh)
        self.received.extend(fresh)
        self.num_received += len(fresh)


class StreamState:
    """What the sync and async token streams share: the assembled result, whether they are done, and that
    one dropped unfinished is closed (ABORT sent)."""

    _asm: Assembler
    _closed: bool

    @property
    def result(self) -> GenerateResult | None:
        return self._asm.result

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens (visual included), once the first reply told it."""
        return self._asm.prompt_tokens

    @property
    def model(self) -> str | None:
        """The served model answering (a group's chosen variant), once the first reply told it."""
        return self._asm.model

    @property
    def done(self) -> bool:
        return self._closed or self._asm.finished

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: sockets may already be gone
            pass


def send_abort(sock: zmq.Socket, request_id: str, api_key: str | None = None) -> None:
    """Send ABORT without blocking; best effort (nothing to abort when no coordinator is connected)."""
    try:
        send(sock, MsgType.ABORT, Abort(request_id=request_id, api_key=api_key).to_body(), flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # zmq.Again included: no coordinator connected, nothing to abort there
        logger.debug("%s ABORT not sent: %s", request_id, exc)


def recv_valid(sock: zmq.Socket, flags: int = 0) -> tuple[MsgType, Reply] | None:
    """One reply, parsed, or None for a malformed one (logged and dropped: it cannot be attributed).

    Raises ``zmq.Again`` under ``zmq.NOBLOCK`` when nothing is queued.
    """
    try:
        _, kind, payload = recv(sock, flags=flags)
        reply = parse_message(kind, payload, TO_CLIENT)
        return reply.KIND, reply  # type: ignore[return-value]
    except (WireError, ProtocolError) as exc:
        logger.warning("dropping malformed reply from coordinator: %s", exc)
        return None
