"""Typed message bodies: a dataclass per message, checked field by field when it arrives.

A message class names its MsgType (`KIND`) and declares each field with `wire(check)`, where
`check(value, where)` returns the field's value or raises ProtocolError naming `where`
(e.g. "PREFILL.prompt_ids"). `to_body()` gives the msgpack-able dict that travels (fields that
are None are left out: readers take the default), `from_body()` the reverse. Unknown fields are
ignored, so newer senders can append fields. `parse_message()` is what a socket calls on every
incoming body: type, endpoint, schema version and fields, in one pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any, ClassVar, TypeVar

from mserve.common.protocol.core import MsgType, ProtocolError, body
from mserve.common.serde import SCHEMA_VERSION

Check = Callable[[Any, str], Any]
K = TypeVar("K", bound=IntEnum)


def wire(check: Check, default: Any = dataclasses.MISSING, *, send_none: bool = False) -> Any:
    """A message field checked by `check` on arrival; `default` when the sender left it out (a list,
    a dict or a Message class: a fresh one each time). `send_none`: a None value still travels (a
    field older readers require, even when it has no value)."""
    kw: dict[str, Any] = {"metadata": {"check": check, "send_none": send_none}}
    if isinstance(default, (list, dict)):
        kw["default_factory"] = (list if isinstance(default, list) else dict)
    elif isinstance(default, type):
        kw["default_factory"] = default
    elif default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(**kw)


def rest() -> Any:
    """The fields of an open message (a report, e.g. STATUS_REPLY) that its class does not declare:
    kept as they came, and sent back out as they are, so the report can grow without a schema change."""
    return dataclasses.field(default_factory=dict, metadata={"rest": True})


def _typed(kind: type | tuple[type, ...], name: str) -> Check:
    def check(v: Any, where: str) -> Any:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ProtocolError(f"{where}: expected {name}, got {type(v).__name__}")
        return v
    check.type = kind  # lets list_of check a long list of plain values in one pass
    return check


as_str = _typed(str, "a string")
as_int = _typed(int, "an integer")
as_bool = _typed(bool, "a boolean")
as_bytes = _typed((bytes, bytearray, memoryview), "bytes")
as_map = _typed(dict, "a map")
as_list = _typed((list, tuple), "a list")


def as_float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{where}: expected a number, got {type(v).__name__}")
    return float(v)


def one_of(*values: str) -> Check:
    def check(v: Any, where: str) -> str:
        if v not in values:
            raise ProtocolError(f"{where}: expected one of {', '.join(values)}, got {v!r}")
        return v
    return check


def optional(check: Check) -> Check:
    return lambda v, where: None if v is None else check(v, where)


def list_of(check: Check) -> Check:
    def check_list(v: Any, where: str) -> list:
        if not isinstance(v, (list, tuple)):
            raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
        kind = getattr(check, "type", None)
        if kind is not None and all(type(x) is kind for x in v):  # fast path: prompt ids, token ids
            return list(v)
        return [check(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return check_list


def nested(cls: type[Message]) -> Check:
    return lambda v, where: cls.parse(v, where)


_SPECS: dict[type, tuple[tuple[str, Check | None, type | None, bool, bool, bool], ...]] = {}


def _spec(cls: type) -> tuple[tuple[str, Check | None, type | None, bool, bool, bool], ...]:
    """A message class's fields as (name, check, exact type the check passes as it is or None, required, rest,
    send_none), read from its dataclass fields once: `dataclasses.fields` per message was most of a parse."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple(
            (f.name, f.metadata.get("check"), _exact_type(f.metadata.get("check")),
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
             bool(f.metadata.get("rest")), bool(f.metadata.get("send_none")))
            for f in dataclasses.fields(cls))
    return spec


def _exact_type(check: Check | None) -> type | None:
    kind = getattr(check, "type", None)  # a tuple of types (bytes-like, list-like) never matches `type(v) is`
    return kind if isinstance(kind, type) else None


class Message:
    """Base of every typed body (subclasses are dataclasses)."""

    KIND: ClassVar[MsgType | None] = None
    # A coordinator -> worker message that starts a stage (its arrival begins the stage's worker_s);
    # False for one about a stage already there (more embeddings) or none (handed-back blocks).
    STARTS_STAGE: ClassVar[bool] = True

    def to_body(self) -> dict[str, Any]:
        return body(**self.fields())

    def fields(self) -> dict[str, Any]:
        out = {}
        for name, _check, _kind, _required, is_rest, send_none in _spec(type(self)):
            v = getattr(self, name)
            if is_rest:
                out.update(v)
                continue
            if v is None and not send_none:
                continue
            if isinstance(v, list) and v and isinstance(v[0], Message):
                v = [x.fields() for x in v]
            elif isinstance(v, Message):
                v = v.fields()
            out[name] = v
        return out

    @classmethod
    def from_body(cls, payload: Any) -> Any:
        return cls.parse(payload, cls.KIND.name if cls.KIND is not None else cls.__name__)

    @classmethod
    def parse(cls, payload: Any, where: str) -> Any:
        if not isinstance(payload, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(payload).__name__}")
        values, open_field = {}, None
        for name, check, kind, required, is_rest, _send_none in _spec(cls):
            if is_rest:
                open_field = name
            elif name in payload:
                v = payload[name]
                # A plain value of the field's exact type is what its check would return: skip the call (and
                # the `where` it would be given); anything else goes through the check, which names `where`.
                values[name] = v if type(v) is kind else check(v, f"{where}.{name}")
            elif required:
                raise ProtocolError(f"{where}: missing field {name}")
        if open_field is not None:
            values[open_field] = {k: v for k, v in payload.items() if k not in values and k != "v"}
        return cls(**values)


def accepted_kind(kinds: type[K], msg_type: int, payload: Any, accepted: Mapping[K, type[Message]], *,
                  what: str = "message type", default_version: int | None = None) -> K:
    """The message's kind (a member of `kinds`), once it is one this endpoint accepts and its body a map
    of a schema version this process reads; `what` names the link in errors. Every socket, control
    and data plane, checks a header this one way."""
    try:
        kind = kinds(msg_type)
    except ValueError:
        raise ProtocolError(f"unknown {what} {msg_type}") from None
    if kind not in accepted:
        raise ProtocolError(f"{what} {kind.name} is not accepted here")
    if not isinstance(payload, dict):
        raise ProtocolError(f"{kind.name} body must be a map, got {type(payload).__name__}")
    version = payload.get("v", default_version)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ProtocolError(f"{kind.name}: unsupported schema version {version!r} (this process speaks {SCHEMA_VERSION})")
    return kind


def check_header(msg_type: int, payload: Any, accepted: Mapping[MsgType, type[Message]]) -> MsgType:
    """The message's type, once it is one this endpoint accepts, a map of a schema version this process
    reads, with its class's required fields present (their values are checked by `parse_message`)."""
    kind = accepted_kind(MsgType, msg_type, payload, accepted)
    missing = [f.name for f in dataclasses.fields(accepted[kind])  # type: ignore[arg-type]
               if f.name not in payload and f.default is dataclasses.MISSING and not f.metadata.get("rest")
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ProtocolError(f"{kind.name}: missing field(s) {', '.join(missing)}")
    return kind


def parse_message(msg_type: int, payload: Any, accepted: Mapping[MsgType, type[Message]]) -> Message:
    """An incoming body as its typed message; ProtocolError names what is wrong."""
    kind = check_header(msg_type, payload, accepted)
    return accepted[kind].from_body(payload)
