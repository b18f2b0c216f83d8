"""Coordinator -> worker: the stage a worker of one role runs for one attempt of one request.

Each body names the coordinator's request id and attempt number: a worker echoes both, so the
coordinator can tell a live reply from one of an attempt it already re-ran elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mserve.common import sampling_rules as rules
from mserve.common.policy import LATENCY_CLASSES
from mserve.common.protocol.client import MediaRef, RequestClass, Sampling, Signed
from mserve.common.protocol.core import MsgType
from mserve.common.protocol.typed import (Message, as_bool, as_bytes, as_float, as_int, as_list, as_map, as_str,
                                          list_of, nested, one_of, optional, wire)


@dataclass
class ImageRef(Message):
    """One image of a request: its bytes and the hash caches key on. A video is one ImageRef too: its
    frames (`frames`, `data` empty), or a video file (`data`) and the frames of it to use (`frame_indices`);
    so is an audio clip: its file (`data`) and the samples it is held to (`audio_samples`, common/audio.py)."""

    hash: str = wire(as_str)
    data: bytes = wire(as_bytes)
    frames: list[bytes] | None = wire(optional(list_of(as_bytes)), None)
    frame_indices: list[int] | None = wire(optional(list_of(as_int)), None)
    fps: float | None = wire(optional(as_float), None)  # a video's sampled frame rate (None: unknown)
    audio_samples: int | None = wire(optional(as_int), None)  # an audio clip's length at its feature rate
    # An image held in a media store (`data` empty): the worker pulls its bytes (common/media_store.py).
    media: MediaRef | None = wire(optional(nested(MediaRef)), None)

    @property
    def is_video(self) -> bool:
        return self.frames is not None or self.frame_indices is not None

    @property
    def num_frames(self) -> int:
        """Frames the vision tower sees (1 for an image)."""
        return len(self.frames if self.frames is not None else self.frame_indices) if self.is_video else 1


@dataclass
class StageTask(RequestClass):
    """A stage of one attempt of one request (ENCODE, PREFILL, RUN): the ids its worker echoes back, and
    the request's class and the stage's trace span (RequestClass)."""

    request_id: str = wire(as_str)
    attempt: int = wire(as_int)


@dataclass
class PromptTask(StageTask):
    """A stage that runs the prompt (PREFILL, RUN): its tokens, how to sample, and what was streamed."""

    prompt_ids: list[int] = wire(list_of(as_int))
    sampling: Sampling = wire(nested(Sampling))
    output_ids: list[int] = wire(list_of(as_int), [])  # tokens an earlier attempt already streamed


@dataclass
class EncodeTask(StageTask):
    KIND: ClassVar = MsgType.ENCODE
    images: list[ImageRef] = wire(list_of(nested(ImageRef)))
    # This request's own pruning ratio (SLO-adaptive pruning); None: the worker's --visual-token-pruning.
    keep_ratio: float | None = wire(optional(as_float), None)


@dataclass
class EmbeddingPart(Message):
    descriptor: dict[str, Any] = wire(as_map)  # transfer descriptor on the encode worker that made the part
    images: list[int] = wire(list_of(as_int))  # the request's images it holds, in order: img0, img1, ...
    grids: list[Any] | None = wire(optional(list_of(optional(list_of(as_int)))), None)  # Qwen2-VL, per image


@dataclass
class PrefillTask(PromptTask):
    KIND: ClassVar = MsgType.PREFILL
    image_hashes: list[str] = wire(list_of(as_str), [])
    embeddings: dict[str, Any] | None = wire(optional(as_map), None)  # transfer descriptor (on an encode worker)
    grids: list[Any] | None = wire(optional(list_of(optional(list_of(as_int)))), None)  # Qwen2-VL (t, h, w)
    # Images encoded on several encode workers at once (instead of `embeddings`): each part's
    # descriptor, and which of the request's images (by index) its tensors img0..imgK are.
    embedding_parts: list[EmbeddingPart] | None = wire(optional(list_of(nested(EmbeddingPart))), None)
    # Images still encoding when this PREFILL was sent (they follow as EMBEDDINGS), and every image's
    # visual tokens (so the prompt's placeholder runs map to images before they arrive).
    pending_images: list[int] = wire(list_of(as_int), [])
    image_tokens: list[int] = wire(list_of(as_int), [])
    # Each image's sampled frame rate (a video's; None for an image or an unknown rate): Qwen2.5-VL's
    # M-RoPE spaces a video's temporal positions by it (second_per_grid_ts). None: no video.
    item_fps: list[float | None] | None = wire(optional(list_of(optional(as_float))), None)
    # Images not encoded: the chosen worker's cached prefix holds their placeholders (workers/prefix_skip.py).
    # With `image_tokens`, and `grids` for M-RoPE; should the blocks be gone, the prefill fails retryably.
    skipped_images: list[int] = wire(list_of(as_int), [])


@dataclass
class KVState(Message):
    """A prefilled request as it leaves its prefill engine, less its tensors (the KV blocks, M-RoPE
    positions and image embeddings travel on the data plane): PREFILLED carries it to the coordinator,
    DECODE on to the decode worker, whose engine adopts the request from it."""

    request_id: str = wire(as_str)  # the prefill engine's (a decode worker renames it to its DECODE's)
    prompt_ids: list[int] = wire(list_of(as_int))
    output_ids: list[int] = wire(list_of(as_int))
    num_computed_tokens: int = wire(as_int)
    block_size: int = wire(as_int)
    images: list[Any] = wire(list_of(as_list))  # [start, length, image hash] per image of the prompt
    sampling: Sampling = wire(nested(Sampling))
    rope_delta: int = wire(as_int, 0)
    priority: int = wire(as_int, rules.PRIORITY)
    latency_class: str = wire(one_of(*LATENCY_CLASSES), "interactive")


@dataclass
class DecodeTask(Message):
    KIND: ClassVar = MsgType.DECODE
    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    descriptor: dict[str, Any] = wire(as_map)  # the prefilled KV (on a prefill worker)
    state: KVState = wire(nested(KVState))
    # At the end, publish the full KV blocks of the reply for the prefill worker that holds the prompt's
    # (the coordinator's --kv-hand-back): a next turn that resends prompt + reply then finds them cached.
    hand_back: bool = wire(as_bool, False)
    report_every: int = wire(as_int, 1)  # see RunTask
    tokens_to: str | None = wire(optional(as_str), None)
    client_rid: str | None = wire(optional(as_str), None)
    trace: str | None = wire(optional(as_str), None)  # the coordinator's stage span (common/tracing.py)


@dataclass
class RunTask(PromptTask):
    """All three stages on a unified worker."""

    KIND: ClassVar = MsgType.RUN
    images: list[ImageRef] = wire(list_of(nested(ImageRef)), [])
    # Tokens off the coordinator (its --token-report-every, docs/scaling.md): the worker reports this
    # request's tokens to the coordinator only every `report_every` tokens (and its first and last), and
    # when the client gave `tokens_to` (its token sink) it streams each step's tokens there itself, as
    # TOKENS under the client's request id `client_rid`.
    report_every: int = wire(as_int, 1)
    tokens_to: str | None = wire(optional(as_str), None)
    client_rid: str | None = wire(optional(as_str), None)


@dataclass
class Cancel(Message):
    KIND: ClassVar = MsgType.CANCEL
    request_id: str = wire(as_str)


@dataclass
class Shutdown(Message):
    KIND: ClassVar = MsgType.SHUTDOWN


# The roles a worker can switch between: each holds the whole text model (an encode worker holds the vision tower only).
SWITCHABLE_ROLES = ("prefill", "decode", "unified")


@dataclass
class SwitchRole(Signed):
    """Drain, then serve as `role` (coordinator/role_switching.py): from an operator to the coordinator
    (`mserve switch-role`), and from the coordinator to the worker it names."""

    KIND: ClassVar = MsgType.SWITCH_ROLE
    STARTS_STAGE: ClassVar = False
    worker_id: str = wire(as_str)
    role: str = wire(one_of(*SWITCHABLE_ROLES))


@dataclass
class AdoptBlocks(Message):
    """KV blocks a decode worker handed back: the prefill worker keeps them as cached prefix blocks."""

    KIND: ClassVar = MsgType.ADOPT
    STARTS_STAGE: ClassVar = False
    request_id: str = wire(as_str)  # the finished request they come from (for logs)
    descriptor: dict[str, Any] = wire(as_map)  # "kv": [layers, 2, n, block_size, kv_heads, head_dim] on the decode worker
    token_ids: list[int] = wire(list_of(as_int))  # prompt + reply, through the last handed-back block
    images: list[Any] = wire(list_of(as_list), [])  # [start, length, image hash] per image of the prompt
    first_block: int = wire(as_int, 0)  # the first block handed back (the ones before it are the prompt's)


@dataclass
class Embeddings(Message):
    """More of a running prefill's images: parts whose encoders finished after its PREFILL was sent."""

    KIND: ClassVar = MsgType.EMBEDDINGS
    STARTS_STAGE: ClassVar = False
    request_id: str = wire(as_str)
    attempt: int = wire(as_int)
    parts: list[EmbeddingPart] = wire(list_of(nested(EmbeddingPart)))


TO_WORKER: dict[MsgType, type[Message]] = {
    cls.KIND: cls for cls in (EncodeTask, PrefillTask, DecodeTask, RunTask, Cancel, Shutdown, AdoptBlocks,
                              Embeddings, SwitchRole)}
