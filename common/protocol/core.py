"""Message types, which roles accept which, error codes, and the body every message travels as.

Frame 0 is one byte (MsgType), frame 1 the msgpack body (see common/serde.py), tensors in extra
frames. Every body is a typed message (common/protocol/typed.py) sent as a map that carries the
schema version "v". New fields are appended last and readers ignore fields they do not know, so
old and new processes can talk.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from mserve.common.policy import LATENCY_CLASSES  # noqa: F401  (re-exported: the wire's classes are the policy's)
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
    # operator (client) -> coordinator, and coordinator -> worker: drain, then serve as another role
    SWITCH_ROLE = 38



ROLES = ("encode", "prefill", "decode", "unified")

# What a worker of each role accepts from the coordinator: a stage message for another role is a
# routing bug, refused loudly rather than run.
_CONTROL = {MsgType.CANCEL, MsgType.SHUTDOWN, MsgType.SWITCH_ROLE}
ROLE_ACCEPTS: dict[str, frozenset[MsgType]] = {
    "encode": frozenset({MsgType.ENCODE, *_CONTROL}),
    "prefill": frozenset({MsgType.PREFILL, MsgType.ADOPT, MsgType.EMBEDDINGS, *_CONTROL}),
    "decode": frozenset({MsgType.DECODE, MsgType.PREFILL, *_CONTROL}),  # PREFILL: lent (coordinator local_prefill_tokens)
    "unified": frozenset({MsgType.RUN, *_CONTROL}),
}


class ProtocolError(ValueError):
    """A message that decoded but is not a valid message of its type."""


def body(**fields: Any) -> dict[str, Any]:
    """A message body with the schema version first."""
    return {"v": SCHEMA_VERSION, **fields}


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
    MODEL_NOT_FOUND = "model_not_found"  # no live worker serves the requested model (message names the served ones)
    LOST = "lost"  # the coordinator no longer holds the request (it restarted): safe to send again
