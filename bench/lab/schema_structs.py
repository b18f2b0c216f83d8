"""lab.schema_choice's candidates: today's GENERATE, HEARTBEAT and STEP_TOKENS declared as msgspec Structs and as
pydantic models, each with the decoder a socket would call (frame 1 -> the typed message, ProtocolError naming the
field path as typed.py does: `HEARTBEAT.load.free_blocks: ...`).

For the measurement only. Field for field as today's classes (common/protocol/client.py, to_coordinator.py):
types, defaults, `one_of` as Literal; the sampling bounds of common/sampling_rules.py as msgspec.Meta and pydantic
Field (the wire does not check them today: admission's pydantic and the engine's SamplingParams do). A GENERATE's
stored image ref is checked as admission finds it in the messages (common/prompt.py), on every path.
"""

import re
from typing import Annotated, Any, Callable, ClassVar, Literal

from mserve.common import sampling_rules as rules
from mserve.common import serde
from mserve.common.policy import LATENCY_CLASSES
from mserve.common.protocol import MsgType, ProtocolError
from mserve.common.serde import SCHEMA_VERSION


def media_parts(body: dict) -> list[tuple[str, Any]]:
    """(where, ref) of each stored media part of a GENERATE body's messages, as admission finds them."""
    out = []
    for i, m in enumerate(body.get("messages") or ()):
        for j, part in enumerate(m.get("content") if isinstance(m.get("content"), list) else ()):
            if isinstance(part, dict) and "media" in part:
                out.append((f"GENERATE.messages[{i}].content[{j}].media", part["media"]))
    return out


# ----------------------------------------------------------------------------- msgspec, the whole base + 3 messages

def msgspec_schema() -> dict[str, Any]:
    """The three messages as msgspec Structs (and MediaRef, for a GENERATE's stored image parts)."""
    from msgspec import Meta, Struct, field

    def bound(name: str) -> Meta:  # a sampling_rules Bound as msgspec Meta
        return Meta(**rules.BOUNDS[name].pydantic())

    class S(Struct, kw_only=True, omit_defaults=True):  # kw_only is per class: a subclass whose required
        pass  # fields follow inherited defaults says it again

    class Sampling(S):
        max_tokens: Annotated[int, bound("max_tokens")] = rules.MAX_TOKENS
        temperature: Annotated[float, bound("temperature")] = rules.TEMPERATURE
        top_k: Annotated[int, bound("top_k")] = rules.TOP_K
        top_p: Annotated[float, bound("top_p")] = rules.TOP_P
        seed: int | None = None
        stop_token_ids: list[int] = []
        ignore_eos: bool = False

    class MediaRef(S):
        hash: str
        nbytes: int
        size: list[int]
        source: dict[str, Any]
        kind: Literal["image", "audio", "video"] = "image"
        sample_rate: int = 0
        samples: int = 0
        frames: int = 0
        fps: float = 0.0

    class Body(S):  # a top-level body: the schema version, required
        v: Annotated[int, Meta(le=SCHEMA_VERSION)]

    class Signed(Body):
        api_key: str | None = None

    class Generate(Signed, kw_only=True):  # today Signed + RequestClass: a Struct takes one base with fields
        KIND: ClassVar = MsgType.GENERATE
        priority: Annotated[int, bound("priority")] = rules.PRIORITY
        latency_class: Literal[LATENCY_CLASSES] = "interactive"  # type: ignore[valid-type]
        trace: str | None = None
        request_id: str
        messages: list[dict[str, Any]]
        sampling: Sampling = field(default_factory=Sampling)
        stream: bool = False
        tokens_to: str | None = None
        model: str | None = None

    class WorkerLoad(S):
        queue_len: int | None = None
        running: int | None = None
        free_blocks: int | None = None
        total_blocks: int | None = None
        tokens_per_s: float | None = None
        rss_mib: float | None = None
        weights_mib: float | None = None
        kv_pool_mib: float | None = None
        state_kib_per_seq: float | None = None
        encode_s_per_image: float | None = None
        queued: list[str] | None = None
        draining: bool | None = None
        counters: dict[str, Any] | None = None
        histograms: dict[str, Any] | None = None
        at: float | None = None
        inflight: int | None = None

    class WorkerInfo(S):  # nested in HEARTBEAT without "v"; READY is it with "v"
        worker_id: str
        role: str
        data_address: str
        host_id: str
        pid: int = 0
        model: str = ""
        block_size: int = 16
        num_blocks: int = 0
        load: WorkerLoad = field(default_factory=WorkerLoad)
        data_key: str | None = None
        visual_token_pruning: float | None = None
        model_path: str = ""

    class Ready(WorkerInfo, kw_only=True):
        KIND: ClassVar = MsgType.READY
        v: Annotated[int, Meta(le=SCHEMA_VERSION)]

    class Heartbeat(Body):
        KIND: ClassVar = MsgType.HEARTBEAT
        worker_id: str
        load: WorkerLoad
        info: WorkerInfo | None = None

    class HandBack(S):
        descriptor: dict[str, Any]
        token_ids: list[int]
        images: list[list[Any]] = []
        first_block: int = 0

    class TokenItem(S):
        request_id: str
        attempt: int
        token_ids: list[int]
        finished: bool = False
        finish_reason: str | None = None
        first: bool = False
        fetch_s: float | None = None
        worker_s: float | None = None
        cached_tokens: int | None = None
        hand_back: HandBack | None = None
        skipped_images: int | None = None
        embedding_hits: int | None = None

    class StepTokens(Body):
        KIND: ClassVar = MsgType.STEP_TOKENS
        items: list[TokenItem]

    del Ready  # declared to count its lines: READY is not one of the three
    return {"GENERATE": Generate, "HEARTBEAT": Heartbeat, "STEP_TOKENS": StepTokens, "MediaRef": MediaRef}


_AT = re.compile(r"(.*) - at `\$(.*)`$", re.S)


def msgspec_decoder(structs: dict[str, Any], kind: str) -> Callable[[bytes], Any]:
    """Frame 1 -> the typed Struct (a GENERATE: with its parts' refs); ProtocolError in typed.py's path style."""
    import msgspec

    dec, ref = msgspec.msgpack.Decoder(structs[kind]), structs["MediaRef"]

    def error(where: str, exc: Exception) -> ProtocolError:  # "... - at `$.load.x`" -> "HEARTBEAT.load.x: ..."
        m = _AT.match(str(exc))
        return ProtocolError(f"{where}{m[2]}: {m[1]}" if m else f"{where}: {exc}")

    def decode(frame: bytes) -> Any:
        try:
            msg = dec.decode(frame)
        except msgspec.ValidationError as exc:
            raise error(kind, exc) from None
        if kind != "GENERATE":
            return msg
        refs = []
        for where, v in media_parts({"messages": msg.messages}):
            try:
                refs.append(msgspec.convert(v, ref))
            except msgspec.ValidationError as exc:
                raise error(where, exc) from None
        return msg, refs
    return decode


# ----------------------------------------------------------------------------- pydantic alone, the same 3 messages

def pydantic_schema() -> dict[str, Any]:
    """The same as pydantic models: strict (no "3" for 3), unknown keys ignored, as the wire's are."""
    from pydantic import BaseModel, ConfigDict, Field

    def bound(name: str, default: Any) -> Any:
        return Field(default, **rules.BOUNDS[name].pydantic())

    class M(BaseModel):
        model_config = ConfigDict(strict=True, extra="ignore")

    class Sampling(M):
        max_tokens: int = bound("max_tokens", rules.MAX_TOKENS)
        temperature: float = bound("temperature", rules.TEMPERATURE)
        top_k: int = bound("top_k", rules.TOP_K)
        top_p: float = bound("top_p", rules.TOP_P)
        seed: int | None = None
        stop_token_ids: list[int] = []
        ignore_eos: bool = False

    class MediaRef(M):
        hash: str
        nbytes: int
        size: list[int]
        source: dict[str, Any]
        kind: Literal["image", "audio", "video"] = "image"
        sample_rate: int = 0
        samples: int = 0
        frames: int = 0
        fps: float = 0.0

    class Body(M):
        v: int = Field(le=SCHEMA_VERSION)

    class Generate(Body):
        KIND: ClassVar = MsgType.GENERATE
        api_key: str | None = None
        priority: int = bound("priority", rules.PRIORITY)
        latency_class: Literal[LATENCY_CLASSES] = "interactive"  # type: ignore[valid-type]
        trace: str | None = None
        request_id: str
        messages: list[dict[str, Any]]
        sampling: Sampling = Field(default_factory=Sampling)
        stream: bool = False
        tokens_to: str | None = None
        model: str | None = None

    class WorkerLoad(M):
        queue_len: int | None = None
        running: int | None = None
        free_blocks: int | None = None
        total_blocks: int | None = None
        tokens_per_s: float | None = None
        rss_mib: float | None = None
        weights_mib: float | None = None
        kv_pool_mib: float | None = None
        state_kib_per_seq: float | None = None
        encode_s_per_image: float | None = None
        queued: list[str] | None = None
        draining: bool | None = None
        counters: dict[str, Any] | None = None
        histograms: dict[str, Any] | None = None
        at: float | None = None
        inflight: int | None = None

    class WorkerInfo(M):
        worker_id: str
        role: str
        data_address: str
        host_id: str
        pid: int = 0
        model: str = ""
        block_size: int = 16
        num_blocks: int = 0
        load: WorkerLoad = Field(default_factory=WorkerLoad)
        data_key: str | None = None
        visual_token_pruning: float | None = None
        model_path: str = ""

    class Ready(WorkerInfo):  # READY: WorkerInfo with "v"
        KIND: ClassVar = MsgType.READY
        v: int = Field(le=SCHEMA_VERSION)

    class Heartbeat(Body):
        KIND: ClassVar = MsgType.HEARTBEAT
        worker_id: str
        load: WorkerLoad
        info: WorkerInfo | None = None

    class HandBack(M):
        descriptor: dict[str, Any]
        token_ids: list[int]
        images: list[list[Any]] = []
        first_block: int = 0

    class TokenItem(M):
        request_id: str
        attempt: int
        token_ids: list[int]
        finished: bool = False
        finish_reason: str | None = None
        first: bool = False
        fetch_s: float | None = None
        worker_s: float | None = None
        cached_tokens: int | None = None
        hand_back: HandBack | None = None
        skipped_images: int | None = None
        embedding_hits: int | None = None

    class StepTokens(Body):
        KIND: ClassVar = MsgType.STEP_TOKENS
        items: list[TokenItem]

    del Ready  # declared to count its lines: READY is not one of the three
    return {"GENERATE": Generate, "HEARTBEAT": Heartbeat, "STEP_TOKENS": StepTokens, "MediaRef": MediaRef}


def pydantic_decoder(models: dict[str, Any], kind: str) -> Callable[[bytes], Any]:
    """msgpack -> the typed model (a GENERATE: with its parts' refs); ProtocolError names the first error's path."""
    from pydantic import ValidationError

    model, ref, head = models[kind], models["MediaRef"], bytes((int(MsgType[kind]),))

    def error(where: str, exc: ValidationError) -> ProtocolError:
        e, more = exc.errors()[0], exc.error_count() - 1
        path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in e["loc"])
        return ProtocolError(f"{where}{path}: {e['msg']}" + (f" (and {more} more)" if more else ""))

    def decode(frame: bytes) -> Any:
        body = serde.decode([head, frame])[1]
        try:
            msg = model.model_validate(body)
        except ValidationError as exc:
            raise error(kind, exc) from None
        if kind != "GENERATE":
            return msg
        refs = []
        for where, v in media_parts(body):
            try:
                refs.append(ref.model_validate(v))
            except ValidationError as exc:
                raise error(where, exc) from None
        return msg, refs
    return decode
