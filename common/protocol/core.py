"""Message types, the endpoints that accept each one, and the check every incoming body passes first.

Frame 0 is one byte (MsgType), frame 1 the msgpack body (see common/serde.py), tensors in extra
frames. Bodies are plain dicts built by the helpers below; each carries the schema version "v".
New fields are appended last and readers ignore fields they do not know, so old and new
processes can talk. `validate()` checks the required fields of an incoming body.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from mserve.common.serde import SCHEMA_VERSION


class MsgType(IntEnum):
    # client -> coordinator (client ROUTER)
    GENERATE = 1
    ABORT = 2
    STATUS = 3
    # coordinator -> client
    TOKENS = 10
    RESULT = 11
    ERROR = 12
    STATUS_REPLY = 13
    # worker -> coordinator (worker ROUTER)
    READY = 20
    HEARTBEAT = 21
    ENCODED = 22
    PREFILLED = 23
    STEP_TOKENS = 24
    FAILED = 25
    BYE = 26
    # coordinator -> worker
    ENCODE = 30
    PREFILL = 31
    DECODE = 32
    RUN = 33
    CANCEL = 34
    SHUTDOWN = 35
    ADOPT = 36  # cached KV blocks handed back to a prefill worker (a finished reply's, for the next turn)
    EMBEDDINGS = 37  # more of a running prefill's images, encoded elsewhere after its PREFILL was sent


# Required body fields of the client link's messages; extra fields are allowed (appended by newer
# versions). The worker links' bodies are typed (to_worker.py, to_coordinator.py) and checked field by
# field when they are parsed.
REQUIRED: dict[MsgType, tuple[str, ...]] = {
    MsgType.GENERATE: ("request_id", "messages"),
    MsgType.ABORT: ("request_id",),
    MsgType.STATUS: (),
    MsgType.TOKENS: ("request_id", "index", "token_ids"),
    MsgType.RESULT: ("request_id", "token_ids", "text", "finish_reason", "timings"),
    MsgType.ERROR: ("request_id", "code", "message"),
    MsgType.STATUS_REPLY: ("workers",),
}

# Which message types each endpoint accepts: anything else is answered with an error / dropped.
CLIENT_TO_COORDINATOR = frozenset({MsgType.GENERATE, MsgType.ABORT, MsgType.STATUS})
WORKER_TO_COORDINATOR = frozenset({MsgType.READY, MsgType.HEARTBEAT, MsgType.ENCODED, MsgType.PREFILLED,
                                   MsgType.STEP_TOKENS, MsgType.FAILED, MsgType.BYE})
COORDINATOR_TO_WORKER = frozenset({MsgType.ENCODE, MsgType.PREFILL, MsgType.DECODE, MsgType.RUN,
                                   MsgType.CANCEL, MsgType.SHUTDOWN, MsgType.ADOPT, MsgType.EMBEDDINGS})
COORDINATOR_TO_CLIENT = frozenset({MsgType.TOKENS, MsgType.RESULT, MsgType.ERROR, MsgType.STATUS_REPLY})

ROLES = ("encode", "prefill", "decode", "unified")

# What a worker of each role accepts from the coordinator: a stage message for another role is a
# routing bug, refused loudly rather than run.
_CONTROL = {MsgType.CANCEL, MsgType.SHUTDOWN}
ROLE_ACCEPTS: dict[str, frozenset[MsgType]] = {
    "encode": frozenset({MsgType.ENCODE, *_CONTROL}),
    "prefill": frozenset({MsgType.PREFILL, MsgType.ADOPT, MsgType.EMBEDDINGS, *_CONTROL}),
    "decode": frozenset({MsgType.DECODE, *_CONTROL}),
    "unified": frozenset({MsgType.RUN, *_CONTROL}),
}


class ProtocolError(ValueError):
    """A message that decoded but is not a valid message of its type."""


def body(**fields: Any) -> dict[str, Any]:
    """A message body with the schema version first."""
    return {"v": SCHEMA_VERSION, **fields}


def validate(msg_type: int, payload: Any, accepted: frozenset[MsgType]) -> MsgType:
    """Check that a decoded message is one this endpoint accepts and has its required fields."""
    try:
        kind = MsgType(msg_type)
    except ValueError:
        raise ProtocolError(f"unknown message type {msg_type}") from None
    if kind not in accepted:
        raise ProtocolError(f"message type {kind.name} is not accepted here")
    if not isinstance(payload, dict):
        raise ProtocolError(f"{kind.name} body must be a map, got {type(payload).__name__}")
    version = payload.get("v")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ProtocolError(f"{kind.name}: unsupported schema version {version!r} (this process speaks {SCHEMA_VERSION})")
    missing = [f for f in REQUIRED.get(kind, ()) if f not in payload]
    if missing:
        raise ProtocolError(f"{kind.name}: missing field(s) {', '.join(missing)}")
    return kind


class ErrorCode:
    """`code` values of ERROR replies: clients can branch on them."""

    BAD_REQUEST = "bad_request"  # the request is malformed or over a limit (message names it)
    TOO_LARGE = "too_large"  # over a size limit: image bytes or pixels, prompt tokens (message names it)
    BAD_MESSAGE = "bad_message"  # the frames did not decode
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    ABORTED = "aborted"
    UNAUTHORIZED = "unauthorized"  # the coordinator requires a client API key: `api_key` missing or wrong
    LOST = "lost"  # the coordinator no longer holds the request (it restarted): safe to send again
