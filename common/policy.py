"""The serving rules every process shares, written once: the class order, each limit's default, the KV budget.

Pure Python (no torch, no sockets, no redis): the coordinator's queues and admission, the workers'
scheduler, block pool and encode queue, and the simulator import these, so no two of them can
drift apart: each rule lives once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# -- the class order ------------------------------------------------------------------------------

LATENCY_CLASSES = ("interactive", "batch")  # in serving order
# A request queued longer than this, at the coordinator or on a worker, goes before every class: a
# bound on how long `batch` work can starve behind a steady stream of `interactive` work, not a
# fairness setting. Lower trades goodput for the tail: on a saturated `disagg:1e1p1d`, 1 s gave the
# image trace TTFT p99 0.64x and goodput 0.12x (bench/lab/NOTEBOOK.md, "CPU placement and class aging").
CLASS_AGING_S = 10.0


def class_rank(priority: int, latency_class: str) -> tuple[int, int]:
    """Where a class stands in the serving order, smaller first: higher priority, then `interactive`
    before `batch`. Queues that break ties within a class by something other than arrival (the
    scheduler's remaining prompt tokens) sort by this, then their own tie-break."""
    return (-priority, LATENCY_CLASSES.index(latency_class))


def aged_class_rank(priority: int, latency_class: str, waited_s: float,
                    aging_s: float = CLASS_AGING_S) -> tuple[int, int, int]:
    """class_rank for a queue where nothing starves: one that has waited longer than `aging_s` goes
    before every class (the aged then sort among themselves by the queue's own tie-break). The
    coordinator's stage queues and a worker's prompt queue both sort by this."""
    if waited_s > aging_s:
        return (0, 0, 0)
    return (1, *class_rank(priority, latency_class))


def serving_order(priority: int, latency_class: str, arrival: float) -> tuple[int, int, float]:
    """The key every class-ordered queue sorts by, smaller served first: class_rank, then the earlier
    arrival. The largest key is the one shed first when a bounded queue is full."""
    return (*class_rank(priority, latency_class), arrival)


def encode_batch(queue: Sequence[T], *, priority: Callable[[T], int], latency_class: Callable[[T], str],
                 images: Callable[[T], int], max_images: int) -> tuple[list[T], list[T]]:
    """(the requests for one vision forward, the rest), from an encode queue in arrival order: in the
    serving order, up to `max_images` images (a video weighs its frames); a request's images go
    together, and one with more images than that goes alone. So an interactive image waits for at most
    one bounded batch."""
    order = sorted(range(len(queue)), key=lambda i: serving_order(priority(queue[i]), latency_class(queue[i]), i))
    take: list[int] = []
    taken_images = 0
    for i in order:
        n = images(queue[i])
        if take and taken_images + n > max_images:
            break
        take.append(i)
        taken_images += n
    chosen = set(take)
    return [queue[i] for i in take], [item for i, item in enumerate(queue) if i not in chosen]


# -- limits ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: checked at admission with a message naming the limit, and the
    image ones again wherever pixels are decoded. These defaults are every process's defaults: the
    coordinator's and the workers' settings and the engine's config take theirs from DEFAULT_LIMITS."""

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    max_prompt_tokens: int = 16384
    max_tokens: int = 4096
    max_video_frames: int = 32  # frames of one video (a video file is sampled down to it)
    video_fps: float = 2.0  # frames sampled per second of a video file (Qwen2-VL's own convention)
    # Audio clips (a family with an audio tower): bytes and seconds of one clip, clips per request. A clip
    # longer than the model's own window (Qwen2-Audio: 30 s) is cut to it, as its feature extractor cuts it.
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 60.0
    max_audio_per_request: int = 8


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class EngineBudget:
    """A worker engine's KV pool and per-step budget, by default. The worker's settings, the engine's
    config, the scheduler, the GPU-share sizing and the coordinator's routing unit take theirs from
    DEFAULT_ENGINE."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 2048  # KV pool blocks
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per engine step
    # Prompt tokens per engine step on a worker: one long prompt delays a short one (and a running
    # stream) by at most one chunk of this size. Chosen by measurement (bench/lab/NOTEBOOK.md,
    # "Prefill chunk cap").
    max_prefill_tokens: int = 512
    reserve_tokens: int = 256  # admission keeps room for this many next tokens of each running request
    # A hybrid (linear-attention) model's prefix hits resume from a copy of the state at a block boundary:
    # at most this many copies, each one sequence's state in bytes (workers/linear_state.py); LRU.
    state_snapshots: int = 32


DEFAULT_ENGINE = EngineBudget()


# -- the KV budget --------------------------------------------------------------------------------


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens: a block begun is a block taken."""
    return -(-num_tokens // block_size)


def request_blocks(prompt_tokens: int, new_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at its longest: its prompt plus every token it may still add."""
    return blocks_for(prompt_tokens + new_tokens, block_size)


def fits_kv(prompt_tokens: int, new_tokens: int, num_blocks: int, block_size: int) -> bool:
    """Whether `num_blocks` blocks can hold a request's prompt and every token it may still add
    (its `max_tokens`, or 1 for a prefill-only stage): one that cannot would only be preempted forever."""
    return request_blocks(prompt_tokens, new_tokens, block_size) <= num_blocks
