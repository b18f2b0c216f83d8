"""Worker -> coordinator: membership (READY, HEARTBEAT, BYE) and the outcome of each stage attempt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mserve.common.protocol.core import MsgType
from mserve.common.protocol.to_worker import KVState
from mserve.common.protocol.typed import (Message, as_bool, as_float, as_int, as_list, as_map, as_str, list_of,
                                          nested, optional, wire)


@dataclass
class WorkerInfo(Message):
    """READY, and every HEARTBEAT: the registration rides along so a restarted coordinator re-admits."""

    KIND: ClassVar = MsgType.READY
    worker_id: str = wire(as_str)
    role: str = wire(as_str)
    data_address: str = wire(as_str)
    host_id: str = wire(as_str)
    pid: int = wire(as_int, 0)
    model: str = wire(as_str, "")
    block_size: int = wire(as_int, 16)
    num_blocks: int = wire(as_int, 0)
    load: dict[str, Any] = wire(as_map, {})  # queue_len, running, free_blocks, total_blocks, tokens_per_s
    data_key: str | None = wire(optional(as_str), None)  # the data plane's CURVE public key (Z85), when it has one
    # The FasterVLM keep ratio this worker prunes images to (None: off); the coordinator refuses an
    # encode or unified worker whose ratio differs from its own (common/pruning.py).
    visual_token_pruning: float | None = wire(optional(as_float), None)
    # The checkpoint folder `model` (the served name) loads from: the coordinator reads that model's
    # tokenizer and processor rules from it when the model's first worker registers ("": the coordinator's --model).
    model_path: str = wire(as_str, "")


@dataclass
class Heartbeat(Message):
    """HEARTBEAT: the load, and (from current workers) the whole registration, as in READY."""

    KIND: ClassVar = MsgType.HEARTBEAT
    worker_id: str = wire(as_str)
    load: dict[str, Any] = wire(as_map)
    role: str | None = wire(optional(as_str), None)
    data_address: str | None = wire(optional(as_str), None)
    host_id: str | None = wire(optional(as_str), None)
    block_size: int | None = wire(optional(as_int), None)
    visual_token_pruning: float | None = wire(optional(as_float), None)
    model: str | None = wire(optional(as_str), None)  # as in READY
    model_path: str | None = wire(optional(as_str), None)

    def registration(self) -> WorkerInfo | None:
        """The READY this heartbeat repeats, if it carries one."""
        if self.role is None or self.data_address is None or self.host_id is None:
            return None
        return WorkerInfo(worker_id=self.worker_id, role=self.role, data_address=self.data_address,
                          host_id=self.host_id, block_size=self.block_size or 16, load=self.load,
                          visual_token_pruning=self.visual_token_pruning, model=self.model or "",
                          model_path=self.model_path or "")


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


TO_COORDINATOR: dict[MsgType, type[Message]] = {
    cls.KIND: cls for cls in (WorkerInfo, Heartbeat, Encoded, Prefilled, StepTokens, Failed, Bye)}
