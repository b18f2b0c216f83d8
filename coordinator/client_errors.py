"""The clients' errors: one exception class per ERROR code, and the ERROR a lost request stands for.

Shared by the sync and async clients through coordinator/client_core.py, which re-exports them.
"""

from __future__ import annotations

from typing import Any

from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.client import Error


class MServeError(Exception):
    """An ERROR reply (or a client-side failure of the same kind); branch on ``code``."""

    default_code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: str | None = None, request_id: str | None = None,
                 retry_after_s: float | None = None) -> None:
        self.code = code or self.default_code
        self.message = message
        self.request_id = request_id
        self.retry_after_s = retry_after_s  # with `overloaded`: about when a retry may be admitted
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{self.code}: {message}{where}")


class BadRequest(MServeError):
    default_code = ErrorCode.BAD_REQUEST


class Overloaded(MServeError):
    default_code = ErrorCode.OVERLOADED


class NoWorkers(MServeError):
    default_code = ErrorCode.NO_WORKERS


class ModelNotFound(MServeError):
    """The request names a model no live worker of this coordinator serves (the message lists the served ones)."""

    default_code = ErrorCode.MODEL_NOT_FOUND


class RequestTimeout(MServeError):
    default_code = ErrorCode.TIMEOUT


class Aborted(MServeError):
    default_code = ErrorCode.ABORTED


class ServerError(MServeError):
    default_code = ErrorCode.INTERNAL


class Unauthorized(MServeError):
    """The coordinator requires a client API key and this client sent none or a wrong one."""

    default_code = ErrorCode.UNAUTHORIZED


class Lost(MServeError):
    """The coordinator no longer holds the request (it restarted mid-request); sending it again is safe."""

    default_code = ErrorCode.LOST


def lost_reply(request_id: str, message: str | None = None) -> tuple[MsgType, Error]:
    """The ERROR a probe's ``unknown_requests`` (or a shard that stopped answering) stands for."""
    return MsgType.ERROR, Error(request_id=request_id, code=ErrorCode.LOST,
                                message=message or "the coordinator no longer holds this request (it restarted); "
                                                   "send it again")


def shard_gone_reply(request_id: str, address: str) -> tuple[MsgType, Error]:
    return lost_reply(request_id, f"the coordinator shard at {address} stopped answering; send it again (another "
                                  "shard takes it)")


_ERRORS_BY_CODE: dict[str, type[MServeError]] = {
    ErrorCode.BAD_REQUEST: BadRequest, ErrorCode.BAD_MESSAGE: BadRequest, ErrorCode.TOO_LARGE: BadRequest, ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.NO_WORKERS: NoWorkers, ErrorCode.TIMEOUT: RequestTimeout, ErrorCode.ABORTED: Aborted,
    ErrorCode.INTERNAL: ServerError, ErrorCode.LOST: Lost, ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.MODEL_NOT_FOUND: ModelNotFound,
}


def error_from_reply(error: Error | dict[str, Any]) -> MServeError:
    """The exception for an ERROR (or its body); unknown codes (newer servers) become ServerError, code kept."""
    if isinstance(error, dict):
        error = Error.from_body({"request_id": None, **error})
    code = error.code or ErrorCode.INTERNAL
    cls = _ERRORS_BY_CODE.get(code, ServerError)
    return cls(error.message, code=code, request_id=error.request_id, retry_after_s=error.retry_after_s)
