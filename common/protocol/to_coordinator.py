"""Worker -> coordinator: membership (READY, HEARTBEAT, BYE) and the outcome of each stage attempt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from mserve.common.protocol.core import MsgType, ProtocolError
from mserve.common.protocol.to_worker import KVState
from mserve.common.protocol.typed import (Message, as_bool, as_float, as_int, as_list, as_map, as_str, list_of,
                                          nested, optional, wire)


@dataclass
class WorkerLoad(Message):
    """A worker's load report (READY and HEARTBEAT `load`; Redis keeps a flat copy, workers/worker_redis.py).
    Every field may be left out, None meaning "not reported": the coordinator keeps what it had. The one
    spelling of each load key: the coordinator, `mserve status`, the gateway's metrics and dashboard and
    the autoscaler read these attributes (or `read()` a snapshot into them)."""

    queue_len: int | None = wire(optional(as_int), None)  # requests held, not started
    running: int | None = wire(optional(as_int), None)
    free_blocks: int | None = wire(optional(as_int), None)  # of its KV pool
    total_blocks: int | None = wire(optional(as_int), None)
    tokens_per_s: float | None = wire(optional(as_float), None)  # EWMA
    rss_mib: float | None = wire(optional(as_float), None)  # the process's resident memory, and what it holds:
    weights_mib: float | None = wire(optional(as_float), None)
    kv_pool_mib: float | None = wire(optional(as_float), None)
    state_kib_per_seq: float | None = wire(optional(as_float), None)  # a hybrid model's linear state per sequence
    encode_s_per_image: float | None = wire(optional(as_float), None)  # an encoder's measured vision time per image
    queued: list[str] | None = wire(optional(list_of(as_str)), None)  # the request ids behind `queue_len`
    draining: bool | None = wire(optional(as_bool), None)  # SIGTERM (or a role switch): route it nothing new
    counters: dict[str, Any] | None = wire(optional(as_map), None)  # engine and transfer counters
    histograms: dict[str, Any] | None = wire(optional(as_map), None)  # {"step_seconds": snapshot}
    at: float | None = wire(optional(as_float), None)  # the worker's wall clock when measured
    # Not a worker's: the stages the coordinator handed it and has not seen finish (STATUS_REPLY only).
    inflight: int | None = wire(optional(as_int), None)

    @classmethod
    def read(cls, snapshot: Any) -> WorkerLoad:
        """A load as a report or a Redis hash holds it (status tools, the autoscaler, the coordinator's
        Redis read): each field whose value checks, the others None (a reader of snapshots never raises).
        Redis keeps a flag as 0 or 1 (common/redis_store.py): read back as the flag."""
        if not isinstance(snapshot, dict):
            return cls()
        values = {}
        for f in dataclasses.fields(cls):
            v, check = snapshot.get(f.name), f.metadata["check"]
            for value in (v, bool(v)) if v in (0, 1) and not isinstance(v, bool) else (v,):
                try:  # a flag refuses 0 or 1 as a number, then reads it as the flag
                    values[f.name] = check(value, f.name)
                    break
                except ProtocolError:
                    pass
        return cls(**values)


@dataclass
class WorkerInfo(Message):
    """READY; every HEARTBEAT carries it too (`Heartbeat.info`), so a restarted coordinator re-admits."""

    KIND: ClassVar = MsgType.READY
    worker_id: str = wire(as_str)
    role: str = wire(as_str)
    data_address: str = wire(as_str)
    host_id: str = wire(as_str)
    pid: int = wire(as_int, 0)
    model: str = wire(as_str, "")
    block_size: int = wire(as_int, 16)
    num_blocks: int = wire(as_int, 0)
    load: WorkerLoad = wire(nested(WorkerLoad), WorkerLoad)
    data_key: str | None = wire(optional(as_str), None)  # the data plane's CURVE public key (Z85), when it has one
    # The FasterVLM keep ratio this worker prunes images to (None: off); the coordinator refuses an
    # encode or unified worker whose ratio differs from its own (common/pruning.py).
    visual_token_pruning: float | None = wire(optional(as_float), None)
    # The checkpoint folder `model` (the served name) loads from: the coordinator reads that model's
    # tokenizer and processor rules from it when the model's first worker registers ("": the coordinator's --model).
    model_path: str = wire(as_str, "")


@dataclass
class Heartbeat(Message):
    """HEARTBEAT: the load, and the worker's registration (its READY, less the load that travels once, at
    the top): a coordinator that restarted, or declared the worker dead, re-admits it from it."""

    KIND: ClassVar = MsgType.HEARTBEAT
    worker_id: str = wire(as_str)
    load: WorkerLoad = wire(nested(WorkerLoad))
    info: WorkerInfo | None = wire(optional(nested(WorkerInfo)), None)

    @classmethod
    def of(cls, info: WorkerInfo) -> Heartbeat:
        """The heartbeat that repeats `info`."""
        return cls(worker_id=info.worker_id, load=info.load, info=dataclasses.replace(info, load=WorkerLoad()))

    def registration(self) -> WorkerInfo | None:
        """The READY this heartbeat repeats, with its load, if it carries one."""
        return None if self.info is None else dataclasses.replace(self.info, load=self.load)


@dataclass
class EncodedImageInfo(Message):
    hash: str = wire(as_str)
    tokens: int = wire(as_int)
    grid: list[int] | None = wire(optional(list_of(as_int)), None)


@dataclass
class Encoded(Message):
    KIND: ClassVar = MsgType.ENCODED
    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    descriptor: dict[str, Any] = wire(as_map)  # the embeddings, tensors img0..imgN
    images: list[EncodedImageInfo] = wire(list_of(nested(EncodedImageInfo)))
    cache_hits: int = wire(as_int, 0)
    worker_s: float = wire(as_float, 0.0)
    preprocess_s: float = wire(as_float, 0.0)  # the batch's decoding / resampling of its new items (preprocessing)


@dataclass
class Prefilled(Message):
    KIND: ClassVar = MsgType.PREFILLED
    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    token_id: int = wire(as_int)
    finish_reason: str = wire(as_str)  # "prefilled": decode goes on elsewhere; else the request ended here
    fetch_s: float = wire(as_float, 0.0)
    cached_tokens: int = wire(as_int, 0)
    descriptor: dict[str, Any] | None = wire(optional(as_map), None)  # the KV, when "prefilled"
    state: KVState | None = wire(optional(nested(KVState)), None)  # the request, when "prefilled"
    worker_s: float = wire(as_float, 0.0)
    skipped_images: int = wire(as_int, 0)  # images not encoded: the cached prefix held them (prefix_skip.py)


@dataclass
class HandBack(Message):
    """A finished DECODE's reply blocks, published for the prefill worker that holds its prompt's: the
    coordinator relays them as ADOPT (AdoptBlocks' fields but request_id, see to_worker.py)."""

    descriptor: dict[str, Any] = wire(as_map)  # "kv" on the decode worker
    token_ids: list[int] = wire(list_of(as_int))
    images: list[Any] = wire(list_of(as_list), [])
    first_block: int = wire(as_int, 0)


@dataclass
class TokenItem(Message):
    """One request's new tokens from one engine step of a decode or unified worker."""

    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    token_ids: list[int] = wire(list_of(as_int))
    finished: bool = wire(as_bool, False)
    finish_reason: str | None = wire(optional(as_str), None)
    first: bool = wire(as_bool, False)  # the attempt's first tokens (unified: ends its prefill time)
    fetch_s: float | None = wire(optional(as_float), None)
    worker_s: float | None = wire(optional(as_float), None)  # with the last tokens
    cached_tokens: int | None = wire(optional(as_int), None)  # with the last tokens
    hand_back: HandBack | None = wire(optional(nested(HandBack)), None)  # last tokens of a DECODE that asked
    # Unified, with the last tokens: images not encoded for the cached prefix, and those read from an embedding cache.
    skipped_images: int | None = wire(optional(as_int), None)
    embedding_hits: int | None = wire(optional(as_int), None)


@dataclass
class StepTokens(Message):
    KIND: ClassVar = MsgType.STEP_TOKENS
    items: list[TokenItem] = wire(list_of(nested(TokenItem)))


@dataclass
class Failed(Message):
    KIND: ClassVar = MsgType.FAILED
    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    message: str = wire(as_str)
    retryable: bool = wire(as_bool, True)  # False: the request itself is bad; no other worker will do better


@dataclass
class Bye(Message):
    KIND: ClassVar = MsgType.BYE
    worker_id: str = wire(as_str)
    switching_to: str | None = wire(optional(as_str), None)  # it leaves to come back as this role (SWITCH_ROLE)


def registration_of(msg: Message) -> WorkerInfo | None:
    """The registration a worker's message carries: a READY's, or a HEARTBEAT's that repeats it."""
    return msg if isinstance(msg, WorkerInfo) else msg.registration() if isinstance(msg, Heartbeat) else None


TO_COORDINATOR: dict[MsgType, type[Message]] = {
    cls.KIND: cls for cls in (WorkerInfo, Heartbeat, Encoded, Prefilled, StepTokens, Failed, Bye)}
