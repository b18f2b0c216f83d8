"""What a coordinator request is made of, and what the pure request machine asks of the outside.

RequestState is one request's progress through its stages, and RequestTable holds one per request;
`stage_message` builds the one message that starts a stage on a worker. ToClient / ToWorker are the
messages the machine returns for the socket loop to send, collected in the Outbox of the step
being taken; Lookups is how Redis-backed cache hints reach it
(NoLookups: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Protocol, Union

from mserve.common.protocol import Message, MsgType
from mserve.common.protocol.client import Error, Result
from mserve.common.protocol.to_worker import DecodeTask, EmbeddingPart, EncodeTask, ImageRef, PrefillTask, RunTask
from mserve.coordinator.admission import Admitted
from mserve.coordinator.tracing import RequestTrace


class Stage(str, Enum):  # enum.StrEnum once Python 3.10 support goes
    START = "start"  # next_stage only: pick the pipeline (disaggregated or unified) first
    QUEUED = "queued"  # stage only: waiting at the coordinator for a worker to take its next stage
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    RUN = "run"

    def __str__(self) -> str:  # logs and error messages show "prefill", not "Stage.PREFILL"
        return self.value


ACTIVE_STAGES = (Stage.ENCODE, Stage.PREFILL, Stage.DECODE, Stage.RUN)
STAGE_ROLE = {Stage.ENCODE: "encode", Stage.PREFILL: "prefill", Stage.DECODE: "decode", Stage.RUN: "unified"}


class Outgoing:
    """A typed message queued for a socket: the socket loop makes its body (`to_body()`) as it sends."""

    msg: Message

    @property
    def kind(self) -> MsgType:
        return self.msg.KIND

    @property
    def body(self) -> dict[str, Any]:
        return self.msg.fields()


@dataclass(frozen=True)
class ToClient(Outgoing):
    identity: bytes
    msg: Message


@dataclass(frozen=True)
class ToWorker(Outgoing):
    worker_id: str
    msg: Message


Out = Union[ToClient, ToWorker]


class Outbox:
    """What a step's update phase answers, in send order, and the time the step is taken at.

    The request machine's step opens it (`begin`) and hands its messages to the socket loop (`take`);
    the parts acting in the update phase (replies, lifecycle, role switches) only append. The schedule
    phase returns its stage messages itself (Dispatcher.schedule), sent after these."""

    def __init__(self) -> None:
        self.now = 0.0  # the step's clock; status reads the last one
        self._messages: list[Out] = []

    def begin(self, now: float) -> None:
        self.now, self._messages = now, []

    def take(self) -> list[Out]:
        out, self._messages = self._messages, []
        return out

    def to_worker(self, worker_id: str, msg: Message) -> None:
        self._messages.append(ToWorker(worker_id, msg))

    def to_client(self, client: bytes, msg: Message) -> None:
        self._messages.append(ToClient(client, msg))

    def error(self, client: bytes, request_id: str | None, code: str, message: str, **extra: Any) -> None:
        self.to_client(client, Error(request_id=request_id, code=code, message=message, **extra))


class Lookups(Protocol):
    """Cache hints shared through Redis by the workers."""

    def embedding_holders(self, image_hash: str) -> set[str]: ...

    def prefix_hits(self, admitted: Admitted, block_size: int, sent_since: float | None = None) -> dict[str, int]:
        """Who holds the prompt's leading blocks, by worker; `sent_since`: count what this coordinator
        sent a worker itself (`placed`) only from then on."""

    def placed(self, admitted: Admitted, block_size: int, worker_id: str, now: float = 0.0) -> None:
        """The request's prompt was sent to `worker_id` to prefill at `now`: it will hold those blocks."""

    def forget(self, worker_id: str) -> None:
        """The worker is gone: credit it with nothing any more."""


class NoLookups:
    def embedding_holders(self, image_hash: str) -> set[str]:
        return set()

    def prefix_hits(self, admitted: Admitted, block_size: int, sent_since: float | None = None) -> dict[str, int]:
        return {}

    def placed(self, admitted: Admitted, block_size: int, worker_id: str, now: float = 0.0) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        pass


@dataclass
class EncodePart:
    """One encode worker's share of a request whose images are encoded on several at once."""

    worker_id: str
    images: list[int]  # indices into the request's images
    descriptor: dict | None = None  # its embeddings, once ENCODED
    grids: list | None = None


@dataclass
class RequestState:
    rid: str  # coordinator-internal id, unique across clients
    client: bytes
    admitted: Admitted
    arrived: float
    attempt: int = 0
    # Attempts whose stage message never reached its worker (the send failed): they did not run, so
    # they do not count toward max_attempts (a dead host must not use up a request's retries).
    undelivered: int = 0
    next_stage: Stage = Stage.START
    stage: Stage = Stage.QUEUED
    worker_id: str | None = None
    stage_started: float = 0.0
    deadline: float = 0.0
    embeddings: dict | None = None  # descriptor of the encoded images (on an encode worker)
    embeddings_from: str | None = None
    image_grids: list | None = None
    kv: dict | None = None  # descriptor + state of the prefilled request (on a prefill worker)
    kv_from: str | None = None
    output_ids: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in (
        "queue_s", "encode_s", "prefill_s", "transfer_s", "decode_s", "worker_s")})
    cache_hits: dict[str, int] = field(default_factory=lambda: {"embedding": 0, "prefix_tokens": 0})
    charged: list[tuple[str, int]] = field(default_factory=list)  # (worker, prompt tokens) per open stage
    first_token_at: float | None = None
    # An ENCODE spread over several encoders (routing.spread_encode), primary (worker_id) first; empty
    # when one encoder takes every image (then `embeddings` holds them all).
    parts: list[EncodePart] = field(default_factory=list)
    encode_started: float = 0.0  # when its ENCODE went out (a spread one's prefill may start before it ends)
    trace: RequestTrace | None = None  # its open spans while tracing is on (coordinator/tracing.py)
    # Images not encoded because `skip_prefill`'s cached prefix holds them (routing.prefix_covered); its
    # PREFILL goes there. `prefix_skip_off`: an attempt's skip failed (the blocks were gone), so re-runs encode all.
    skipped_images: list[int] = field(default_factory=list)
    skip_prefill: str | None = None
    # Prompt tokens the prefill / unified worker it was routed to likely holds as cached prefix blocks
    # (dispatch._credit): its stage charges that worker only the rest.
    prefix_credit: int = 0
    prefix_skip_off: bool = False

    @property
    def client_rid(self) -> str:
        return self.admitted.request.request_id

    @property
    def has_images(self) -> bool:
        return bool(self.admitted.images)

    def embedding_sources(self) -> set[str]:
        """The encode workers holding (or making) this attempt's embeddings."""
        return {p.worker_id for p in self.parts} or ({self.embeddings_from} if self.embeddings_from else set())

    def stage_workers(self) -> set[str]:
        """The workers running this attempt's open stages: its stage's worker (every part's during a
        spread ENCODE), and the encoders of parts still encoding once prefill has started."""
        running = {p.worker_id for p in self.parts if p.descriptor is None or self.stage == Stage.ENCODE}
        if self.stage in ACTIVE_STAGES and self.worker_id is not None:
            running.add(self.worker_id)
        return running

    def needs(self, worker_id: str) -> bool:
        """True while this attempt cannot go on without `worker_id`: a stage open there, or its
        embeddings or prefilled KV parked there and not yet fetched (the next stage reads them)."""
        if worker_id in self.stage_workers():
            return True
        if self.next_stage == Stage.PREFILL and self.stage in (Stage.QUEUED, Stage.PREFILL):
            return (self.embeddings is not None or bool(self.parts)) and worker_id in self.embedding_sources()
        return self.next_stage == Stage.DECODE and self.stage == Stage.QUEUED and self.kv is not None \
            and self.kv_from == worker_id


class RequestTable:
    """The coordinator's requests, one RequestState each, by internal id; also found by the client's
    (identity, request_id). That index is derived here and written only by `add` and `remove`, so it
    never drifts from the table."""

    def __init__(self) -> None:
        self._by_rid: dict[str, RequestState] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}

    def add(self, st: RequestState) -> None:
        self._by_rid[st.rid] = st
        self._by_client[(st.client, st.client_rid)] = st.rid

    def remove(self, st: RequestState) -> None:
        self._by_rid.pop(st.rid, None)
        self._by_client.pop((st.client, st.client_rid), None)

    def find(self, client: bytes, client_rid: str) -> RequestState | None:
        """The request a client knows by `client_rid`, if it is in flight here."""
        rid = self._by_client.get((client, client_rid))
        return None if rid is None else self._by_rid[rid]

    def get(self, rid: str) -> RequestState | None:
        return self._by_rid.get(rid)

    def __getitem__(self, rid: str) -> RequestState:
        return self._by_rid[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._by_rid)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._by_rid.values())

    def values(self) -> list[RequestState]:
        """A copy: handlers end requests while walking it."""
        return list(self._by_rid.values())


def stage_message(st: RequestState, stage: Stage, hand_back: bool = False, part: list[int] | None = None,
                  report_every: int = 1, trace: str | None = None) -> tuple[Message, int]:
    """The message that starts `stage` of a request on a worker, and the prompt tokens it charges there.
    `hand_back`: a DECODE asks for the reply's KV blocks at the end (the coordinator's kv_hand_back).
    `part`: an ENCODE of only these images (by index; a spread encode). `report_every`: a DECODE or RUN
    reports tokens that often, and streams them to the client's token sink itself (direct_tokens).
    `trace`: the stage span's traceparent, when tracing is on."""
    a, req = st.admitted, st.admitted.request
    ids = {"request_id": st.rid, "attempt": st.attempt, "trace": trace}
    images = [ImageRef(hash=im.hash, data=im.data, frames=im.frames, frame_indices=im.frame_indices,
                       fps=im.fps, audio_samples=im.audio_samples, media=im.media) for im in a.images]
    classes = {"priority": req.priority, "latency_class": req.latency_class}
    tokens = 0
    if stage == Stage.ENCODE:
        msg = EncodeTask(**ids, images=[images[i] for i in part] if part is not None else images, **classes,
                         keep_ratio=a.keep_ratio)
    elif stage == Stage.PREFILL:
        msg = PrefillTask(**ids, prompt_ids=a.prompt_ids, output_ids=list(st.output_ids), sampling=req.sampling,
                          image_hashes=[im.hash for im in a.images], embeddings=st.embeddings, grids=st.image_grids,
                          item_fps=[im.fps for im in a.images] if any(im.is_video for im in a.images) else None,
                          **embedding_parts(st), **classes)
        if st.skipped_images:
            grids = list(st.image_grids or [None] * len(a.images))
            for i in st.skipped_images:
                grids[i] = a.images[i].grid
            msg.skipped_images, msg.grids = list(st.skipped_images), grids
            msg.image_tokens = [im.num_tokens for im in a.images]
        tokens = len(a.prompt_ids)
    elif stage == Stage.DECODE:
        msg = DecodeTask(**ids, descriptor=st.kv["descriptor"], state=st.kv["state"], hand_back=hand_back,
                         **token_route(st, report_every))
    else:
        msg = RunTask(**ids, prompt_ids=a.prompt_ids, output_ids=list(st.output_ids), sampling=req.sampling,
                      images=images, **classes, **token_route(st, report_every))
        tokens = len(a.prompt_ids)
    return msg, tokens


def direct_tokens(st: RequestState, report_every: int) -> bool:
    """The worker streams this request's tokens to the client itself (the coordinator relays none)."""
    req = st.admitted.request
    return report_every > 1 and req.stream and req.tokens_to is not None


def token_route(st: RequestState, report_every: int) -> dict[str, Any]:
    """A DECODE's or RUN's fields for how its tokens leave the worker ({} : every step, to the coordinator)."""
    if report_every <= 1:
        return {}
    direct = direct_tokens(st, report_every)
    return {"report_every": report_every, "tokens_to": st.admitted.request.tokens_to if direct else None,
            "client_rid": st.client_rid if direct else None}


def embedding_parts(st: RequestState) -> dict[str, Any]:
    """A spread encode's PREFILL fields: the parts in so far, and the images still encoding (they
    follow as EMBEDDINGS) with every image's visual tokens; {} when one encoder had them all."""
    if not st.parts:
        return {}
    pending = sorted(i for p in st.parts if p.descriptor is None for i in p.images)
    return {"embedding_parts": [part_message(p) for p in st.parts if p.descriptor is not None],
            "pending_images": pending,
            "image_tokens": [im.num_tokens for im in st.admitted.images] if pending else []}


def part_message(p: EncodePart) -> EmbeddingPart:
    return EmbeddingPart(descriptor=p.descriptor or {}, images=p.images, grids=p.grids)


def result_message(st: RequestState, finish_reason: str, text: str, now: float) -> Result:
    """The RESULT a finished request ends with."""
    timings = {**{k: round(v, 6) for k, v in st.timings.items()}, "total_s": round(now - st.arrived, 6)}
    return Result(request_id=st.client_rid, token_ids=st.output_ids, text=text, finish_reason=finish_reason,
                  prompt_tokens=len(st.admitted.prompt_ids), visual_tokens=st.admitted.visual_tokens,
                  timings=timings, cache_hits=st.cache_hits, attempts=st.attempt + 1,
                  visual_keep_ratio=st.admitted.keep_ratio, model=st.admitted.model)
