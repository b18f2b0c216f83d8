"""One request's life inside an engine: its tokens, images, blocks, sampling settings and progress.

No torch import here: the scheduler and block accounting are pure Python. The tensors a request
carries (image embeddings, M-RoPE positions) are opaque to everything but the model runner.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from mserve.common import sampling_rules as rules
from mserve.common.hashing import ImageSpan, prompt_block_hashes
from mserve.common.protocol.client import Sampling
from mserve.workers.block_pool import BlockTable


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy (argmax). The defaults and bounds are
    common/sampling_rules.py's, as the wire's."""

    max_tokens: int = rules.MAX_TOKENS
    temperature: float = rules.TEMPERATURE
    top_k: int = rules.TOP_K
    top_p: float = rules.TOP_P
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "temperature", "top_k", "top_p"):
            rules.check(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_wire(cls, s: Sampling) -> SamplingParams:
        """The engine's copy of the wire's sampling parameters (common/protocol/client.py), made once per request."""
        return cls(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                   stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)

    def to_wire(self) -> Sampling:
        return Sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        seed=self.seed, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)


_arrival = itertools.count()


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    images: list[ImageSpan] = field(default_factory=list)
    # One embedding tensor [num_visual_tokens, hidden] per entry of `images`, same order.
    image_embeds: list[Any] = field(default_factory=list)
    # Qwen2-VL: 3-D positions for the prompt [3, prompt_len] and the offset decode adds.
    mrope_positions: Any = None
    rope_delta: int = 0
    priority: int = rules.PRIORITY
    latency_class: str = "interactive"  # or "batch": second to priority in the serving order
    eos_token_ids: tuple[int, ...] = ()
    # Prefill workers stop after the first token and hand the KV blocks on.
    prefill_only: bool = False
    # Decode: at the end, copy the reply's full KV blocks out for a prefill worker (workers/hand_back.py).
    hand_back: bool = False
    # Images still to come (a prefill that started while other encoders were still at work): item index
    # -> the indices into `images` of its placeholder runs, whose `image_embeds` are None until then.
    awaiting: dict[int, list[int]] = field(default_factory=dict)
    # Qwen2-VL: 3-D positions wait for every image's grid; until then only the text before the first image runs.
    positions_pending: bool = False
    item_grids: list[Any] = field(default_factory=list)  # each item's (t, h, w) grid as it arrives (M-RoPE)
    item_fps: list[float | None] = field(default_factory=list)  # each video's sampled frame rate (Qwen2.5-VL M-RoPE)
    # Items not encoded because the cached prefix held their whole placeholder range (workers/prefix_skip.py):
    # item index -> the image to encode should it be needed after all, or None (only another worker can).
    # They also sit in `awaiting`, so nothing reads their missing embeddings.
    deferred: dict[int, Any] = field(default_factory=dict)
    embedding_hits: int = 0  # images read from the embedding tiers instead of encoded (unified)

    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    block_table: BlockTable = field(default_factory=BlockTable)
    arrival: int = field(default_factory=lambda: next(_arrival))
    queued_at: float = 0.0  # the scheduler's clock when it took the request (for aging)
    _prompt_hashes: list[str] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def ready_tokens(self, computed: int | None = None) -> int:
        """How far the sequence can be computed now (from `computed` tokens, default those computed):
        up to the first awaited image past that point, else all of it."""
        done = self.num_computed_tokens if computed is None else computed
        starts = [self.images[i].start for runs in self.awaiting.values() for i in runs if self.images[i].end > done]
        if self.positions_pending and self.images:
            starts.append(self.images[0].start)
        return max(done, min(starts)) if starts else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Higher priority first, then first come first served."""
        return (-self.priority, self.arrival)

    def prompt_hashes(self, block_size: int) -> list[str]:
        if self._prompt_hashes is None:
            self._prompt_hashes = prompt_block_hashes(self.prompt_ids, block_size, self.images)
        return self._prompt_hashes

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and finish the sequence if a stop condition holds."""
        self.output_ids.append(token_id)
        if not self.sampling.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token_id in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        elif self.prefill_only:
            self.finish_reason = "prefilled"
