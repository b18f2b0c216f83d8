"""Client <-> coordinator (and a worker's direct TOKENS to a client): GENERATE, ABORT, STATUS and the replies.

The coordinator parses ABORT and STATUS here at its socket; a GENERATE's content is the outside
world's input, checked by admission (coordinator/admission.py: limits, images, messages, with
messages that name the field) and turned into the `Generate` below. Clients parse every reply here.
`Sampling` is the one wire shape of sampling parameters: GENERATE carries it, and so do PREFILL, RUN
and the prefill -> decode hand-off; a worker turns it into its engine's SamplingParams once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from mserve.common import sampling_rules as rules
from mserve.common.protocol.core import LATENCY_CLASSES, MsgType
from mserve.common.protocol.typed import (Message, as_bool, as_float, as_int, as_map, as_str, list_of,
                                          nested, one_of, optional, rest, wire)

# The kinds of item a media store holds, as the content part's "type" names them.
MEDIA_KINDS = ("image", "audio", "video")


@dataclass
class Signed(Message):
    """A message a client sends the coordinator (GENERATE, ABORT, STATUS, an operator's SWITCH_ROLE).
    `api_key`: the coordinator's client API key, when it requires one (its client_api_key;
    docs/operations.md, "Security"); keyword-only, and never in a repr, so never in a log line. Clients
    sign a body as they send it (`sign`: a body is built once and may go to several shards); the
    coordinator takes the key out before anything else reads the body (`take_api_key`)."""

    api_key: str | None = field(default=None, kw_only=True, repr=False,
                                metadata={"check": optional(as_str), "send_none": False})

    @staticmethod
    def sign(payload: dict[str, Any], api_key: str | None) -> dict[str, Any]:
        """`payload` with the API key in it (unchanged when there is none)."""
        return {**payload, "api_key": api_key} if api_key else payload

    @staticmethod
    def take_api_key(payload: dict[str, Any]) -> Any:
        """The key a body carries (None: none), taken out of it: never kept, passed on or logged. As it
        came: a key that is not a string is a wrong key (ERROR unauthorized), not a bad message."""
        return payload.pop("api_key", None)


@dataclass
class Sampling(Message):
    """How the model picks each next token (temperature 0: greedy). A missing seed travels as no field.
    The defaults and bounds are common/sampling_rules.py's."""

    max_tokens: int = wire(as_int, rules.MAX_TOKENS)
    temperature: float = wire(as_float, rules.TEMPERATURE)
    top_k: int = wire(as_int, rules.TOP_K)
    top_p: float = wire(as_float, rules.TOP_P)
    seed: int | None = wire(optional(as_int), None)
    stop_token_ids: list[int] = wire(list_of(as_int), [])
    ignore_eos: bool = wire(as_bool, False)


@dataclass
class MediaRef(Message):
    """A media item in a media store (common/media_store.py) instead of its bytes: a GENERATE image, audio
    or video part `{"type": KIND, "media": MediaRef}` and an ENCODE / RUN ImageRef carry it. Admission
    counts the item's tokens from its header facts (an image's `size`; a clip's `sample_rate` and
    `samples`; a video file's `size`, `frames` and `fps`) by the model's own rules, as it does inline
    bytes; the worker pulls the bytes from `source` and checks them against `hash`, `nbytes` and the
    facts of its kind (common/media_facts.py) before decoding."""

    hash: str = wire(as_str)  # common/images.py image_hash of the bytes (whatever the kind)
    nbytes: int = wire(as_int)
    size: list[int] = wire(list_of(as_int))  # (width, height) from an image's header or a video's stream
    source: dict[str, Any] = wire(as_map)  # the store's shared transfer descriptor (common/transfer/descriptor.py)
    kind: str = wire(one_of(*MEDIA_KINDS), "image")
    # Audio: the container's sample rate and length in samples per channel at it (common/audio.py AudioInfo).
    sample_rate: int = wire(as_int, 0)
    samples: int = wire(as_int, 0)
    # A video file: its frame count (packets of its first video stream) and rate (0: unknown), as probed.
    frames: int = wire(as_int, 0)
    fps: float = wire(as_float, 0.0)


@dataclass(kw_only=True)
class RequestClass(Message):
    """What every message that carries a request says of it beyond its content: its class and its trace.
    GENERATE declares them here, and so do the stage tasks the coordinator sends for it (ENCODE, PREFILL,
    RUN, common/protocol/to_worker.py): one declaration, one default and one check at every hop."""

    priority: int = wire(as_int, rules.PRIORITY)
    latency_class: str = wire(one_of(*LATENCY_CLASSES), "interactive")
    # A W3C traceparent (common/tracing.py): on GENERATE the caller's span, the request's trace continuing
    # under it; on a stage task the coordinator's span of that stage.
    trace: str | None = wire(optional(as_str), None)


@dataclass
class Generate(Signed, RequestClass):
    KIND: ClassVar = MsgType.GENERATE
    request_id: str = wire(as_str)
    messages: list[dict[str, Any]] = wire(list_of(as_map))
    sampling: Sampling = wire(nested(Sampling), Sampling)
    stream: bool = wire(as_bool, False)
    # The client's token sink (a tcp:// address it binds): with the coordinator's token_report_every > 1
    # the decode worker streams this request's tokens there itself (docs/scaling.md). Ignored otherwise.
    tokens_to: str | None = wire(optional(as_str), None)
    # The served model name (a worker's --model-name) this request is for; None: the coordinator's default
    # (its --model, or the only model it serves). coordinator/models.py maps it to that model's pools.
    model: str | None = wire(optional(as_str), None)


@dataclass
class Abort(Signed):
    KIND: ClassVar = MsgType.ABORT
    request_id: str = wire(as_str)


@dataclass
class Status(Signed):
    """The coordinator's status, or (with `request_ids`, a client's liveness probe) which of these
    requests it no longer holds (STATUS_REPLY's `unknown_requests`)."""

    KIND: ClassVar = MsgType.STATUS
    request_ids: list[str] | None = wire(optional(list_of(as_str)), None)


@dataclass
class Tokens(Message):
    """New tokens of a streamed request, from the coordinator or straight from its decode worker."""

    KIND: ClassVar = MsgType.TOKENS
    request_id: str = wire(as_str)
    index: int = wire(as_int)  # of the first of `token_ids` in the request's output
    token_ids: list[int] = wire(list_of(as_int))
    prompt_tokens: int | None = wire(optional(as_int), None)  # with index 0
    model: str | None = wire(optional(as_str), None)  # with index 0: the served model answering (a variant of a group)


@dataclass
class Result(Message):
    KIND: ClassVar = MsgType.RESULT
    request_id: str = wire(as_str)
    token_ids: list[int] = wire(list_of(as_int))
    text: str = wire(as_str)
    finish_reason: str = wire(as_str)
    timings: dict[str, float] = wire(as_map)  # queue_s, encode_s, ..., total_s
    prompt_tokens: int = wire(as_int, 0)
    visual_tokens: int = wire(as_int, 0)
    cache_hits: dict[str, int] = wire(as_map, {})  # embedding, prefix_tokens
    attempts: int = wire(as_int, 1)
    # The keep ratio this request's images were pruned to when SLO-adaptive pruning chose one (its
    # class broke its TTFT objective); None: not pruned adaptively (the cluster's fixed ratio, if any).
    visual_keep_ratio: float | None = wire(optional(as_float), None)
    # The served model that answered: the request's own `model`, or the variant its group chose
    # (coordinator/variant_policy.py). None from a coordinator older than several models.
    model: str | None = wire(optional(as_str), None)


@dataclass
class Error(Message):
    KIND: ClassVar = MsgType.ERROR
    request_id: str | None = wire(optional(as_str), send_none=True)  # None: a message not tied to a request
    code: str = wire(as_str)  # an ErrorCode; clients map unknown ones to a server error
    message: str = wire(as_str)
    retry_after_s: float | None = wire(optional(as_float), None)  # with `overloaded`


@dataclass
class StatusReply(Message):
    """An open report: the fields below, and whatever else the coordinator reports (roles, stats,
    telemetry, model, ...) kept in `report` as it came."""

    KIND: ClassVar = MsgType.STATUS_REPLY
    workers: dict[str, Any] = wire(as_map)
    unknown_requests: list[str] | None = wire(optional(list_of(as_str)), None)  # the answer to a probe
    report: dict[str, Any] = rest()

    def as_dict(self) -> dict[str, Any]:
        """The whole report, as a client's status() returns it."""
        return self.fields()


FROM_CLIENT: dict[MsgType, type[Message]] = {cls.KIND: cls for cls in (Generate, Abort, Status)}
TO_CLIENT: dict[MsgType, type[Message]] = {cls.KIND: cls for cls in (Tokens, Result, Error, StatusReply)}

__all__ = ["FROM_CLIENT", "LATENCY_CLASSES", "TO_CLIENT", "Abort", "Error", "Generate", "MediaRef", "RequestClass", "Result",
           "Sampling", "Status", "StatusReply", "Tokens"]
