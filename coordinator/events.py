"""What a request machine's step takes in: one event from a client, a worker, the socket loop or the clock.

The socket loop (coordinator/server.py) turns each decoded frame, each failed send and each tick into
one of these and hands it to `RequestMachine.step` (coordinator/requests.py) with the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from mserve.common.protocol import ErrorCode, Message, MsgType
from mserve.coordinator.admission import Admitted


@dataclass(frozen=True)
class Submit:
    """A GENERATE that passed admission."""

    client: bytes
    admitted: Admitted


@dataclass(frozen=True)
class Reject:
    """A GENERATE that failed admission (invalid, or over a limit)."""

    client: bytes
    request_id: str | None
    message: str
    code: str = ErrorCode.BAD_REQUEST


@dataclass(frozen=True)
class Abort:
    client: bytes
    request_id: str


@dataclass(frozen=True)
class FromWorker:
    """A worker's message (TO_COORDINATOR): as the socket parsed it, or a body the step checks."""

    worker_id: str
    kind: MsgType
    payload: Message | dict[str, Any]


@dataclass(frozen=True)
class SwitchRoleTo:
    """Start a role switch `RoleSwitcher.refusal` allowed (an operator's)."""

    worker_id: str
    role: str
    reason: str


@dataclass(frozen=True)
class Unreachable:
    """A send to the worker failed: its socket is gone. `request_id`: the request whose stage message failed."""

    worker_id: str
    why: str
    request_id: str | None = None


@dataclass(frozen=True)
class Tick:
    """Housekeeping: silent workers die, overdue stages re-run, leases renew."""


Event = Union[Submit, Reject, Abort, FromWorker, SwitchRoleTo, Unreachable, Tick]
