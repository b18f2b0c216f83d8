"""Receiver <-> sender on the data plane (common/transfer/): a fetch request, its reply, and the ack.

Private to the data-plane ROUTER each worker's transfer engine binds; its message types are their
own numbers (`DataMsg`), never seen by a control-plane socket. Bodies are typed Messages like the
control plane's, parsed once on arrival (`parse_data`). Senders before the schema version was put on
this link sent no "v": a body without one is read as version 1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from mserve.common.protocol.typed import (Message, accepted_kind, as_bool, as_int, as_list, as_map, as_str, optional, wire)


class DataMsg(enum.IntEnum):
    REQUEST = 1
    DATA = 2
    READY = 3
    ERROR = 4
    ACK = 5


@dataclass
class FetchRequest(Message):
    """Send me transfer `id` over `mode` ("tcp": as frames in DATA; "torch": a point-to-point send, READY
    says how). `rq` numbers the request; the sender echoes it, so a late reply to an earlier one is told apart."""

    KIND: ClassVar = DataMsg.REQUEST
    id: str = wire(as_str)
    mode: str = wire(as_str)
    rq: int | None = wire(optional(as_int), None)
    gid: str | None = wire(optional(as_str), None)  # torch: the process group the receiver holds, if any
    peer: str | None = wire(optional(as_str), None)  # torch: the receiving engine's instance id
    gpu: str | None = wire(optional(as_str), None)  # torch: the receiver's "host/GPU uuid", for CUDA IPC


@dataclass
class TensorData(Message):
    KIND: ClassVar = DataMsg.DATA
    t: dict[str, Any] = wire(as_map)  # the transfer's tensors by name, in layout order
    rq: int | None = wire(optional(as_int), None)


@dataclass
class TorchReady(Message):
    """The sender's torch send has started (or there is nothing to send: `tag` null; or the receiver's
    group went stale: `stale`, build a new one; or both are on one GPU: `ipc`, a CUDA IPC handle to
    copy from, mserve.common.transfer.cuda_ipc)."""

    KIND: ClassVar = DataMsg.READY
    rq: int | None = wire(optional(as_int), None)
    tag: int | None = wire(optional(as_int), None)
    gid: str | None = wire(optional(as_str), None)
    store: list[Any] | None = wire(optional(as_list), None)  # [host, port] of the group's rendezvous store
    stale: bool = wire(as_bool, False)
    ipc: list[Any] | None = wire(optional(as_list), None)


@dataclass
class FetchFailed(Message):
    KIND: ClassVar = DataMsg.ERROR
    error: str = wire(as_str)
    rq: int | None = wire(optional(as_int), None)


@dataclass
class Ack(Message):
    """The receiver is done with transfer `id`: the sender may free it."""

    KIND: ClassVar = DataMsg.ACK
    id: str = wire(as_str)


TO_SENDER: dict[DataMsg, type[Message]] = {cls.KIND: cls for cls in (FetchRequest, Ack)}
TO_RECEIVER: dict[DataMsg, type[Message]] = {cls.KIND: cls for cls in (TensorData, TorchReady, FetchFailed)}


def parse_data(msg_type: int, payload: Any, accepted: dict[DataMsg, type[Message]]) -> Message:
    """A data-plane body as its typed message; ProtocolError names what is wrong. A body without `v`
    is a version-1 sender's (data-plane bodies carried none before)."""
    kind = accepted_kind(DataMsg, msg_type, payload, accepted, what="data-plane message", default_version=1)
    return accepted[kind].from_body(payload)
