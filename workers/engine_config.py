"""What an Engine is built with (EngineConfig), what a caller hands it (RequestInput) and what a step gives
back (StepOutput): the stage engine's plain data, workers/engine.py its behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from mserve.common import sampling_rules as rules
from mserve.common.policy import CLASS_AGING_S, DEFAULT_ENGINE, DEFAULT_LIMITS
from mserve.common.video import VideoPart
from mserve.workers.hand_back import ReplyBlocks
from mserve.workers.sequence import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # None: the serving default for the device (common/serving_defaults.py)
    block_size: int = DEFAULT_ENGINE.block_size
    num_blocks: int = DEFAULT_ENGINE.num_blocks
    max_num_seqs: int = DEFAULT_ENGINE.max_num_seqs
    max_num_batched_tokens: int = DEFAULT_ENGINE.max_num_batched_tokens
    max_prefill_tokens: int | None = None  # prompt tokens per step (the chunk cap); None: the whole budget
    reserve_tokens: int = DEFAULT_ENGINE.reserve_tokens
    class_aging_s: float = CLASS_AGING_S  # a prompt queued longer goes before every class
    enable_prefix_caching: bool = True
    state_snapshots: int = DEFAULT_ENGINE.state_snapshots  # a hybrid model's prefix-hit states (LinearStates)
    max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels
    max_image_bytes: int = DEFAULT_LIMITS.max_image_bytes
    threads: int | None = None
    parts: str = "all"  # "vision" (encode), "text" (prefill/decode) or "all": which weights stay loaded
    visual_token_pruning: float | None = None  # FasterVLM keep ratio on the encode path; None = off (common/pruning.py)
    # Attention over each request's exact key count: HF bf16's bits where its top-2 logits tie, at a
    # fraction of the rate. None / False: one padded call per group (workers/paged_attention.exact_setting).
    exact_attention: bool | None = None
    # Decode steps through torch.compile (ModelRunner._compile_decode); off: it pays at small batches only
    # and the first decode steps compile for 10-30 s (bench/lab/NOTEBOOK.md, "Where a decode step's time goes").
    compile: bool = False


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    # Decode with hand-back: the finished reply's full KV blocks, copied out for a prefill worker
    # (workers/hand_back.py); None when there are none.
    hand_back: ReplyBlocks | None = None


@dataclass
class RequestInput:
    """What a caller hands the engine: prompt ids with placeholders already expanded, plus images."""

    request_id: str
    prompt_ids: list[int]
    images: list[bytes | VideoPart] = field(default_factory=list)  # images and videos, in prompt order
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = rules.PRIORITY
