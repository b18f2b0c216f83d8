"""Routing policy: which worker of a role takes the next stage of a request. Pure Python, no sockets.

Inputs are the coordinator's view of each worker (liveness, the load it reports through Redis and
heartbeats, and the stages the coordinator has handed it but not yet seen finish) plus cache
affinity. Text-only requests skip encode; an image already encoded goes where reading it back is
cheaper than encoding it again (see route_encode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from mserve.common.policy import DEFAULT_ENGINE
from mserve.common.hashing import host_member
from mserve.common.prefix_rules import covered, reusable_blocks


@dataclass
class WorkerView:
    worker_id: str
    role: str
    host_id: str = ""  # workers with the same host_id share /dev/shm (and the host's L2 embedding cache)
    alive: bool = True
    queue_len: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0
    rss_mib: float = 0.0  # the worker process's resident memory, and what it holds:
    weights_mib: float = 0.0
    kv_pool_mib: float = 0.0
    state_kib_per_seq: float = 0.0  # a hybrid model's linear-attention state per running sequence
    encode_s_per_image: float = 0.0  # an encode worker's measured vision-forward time per image (0: not yet)
    # Stages assigned by the coordinator and not finished yet: fresher than the reported load.
    inflight: int = 0
    inflight_tokens: int = 0
    reserved_blocks: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def busy(self) -> float:
        return self.inflight + self.queue_len + 0.5 * self.running

    @property
    def spare_blocks(self) -> int:
        return self.free_blocks - self.reserved_blocks


def alive(workers: Iterable[WorkerView], role: str) -> list[WorkerView]:
    return [w for w in workers if w.alive and w.role == role]


# Until an encoder has measured itself: about one small image through a small vision tower on a CPU core.
DEFAULT_ENCODE_S_PER_IMAGE = 0.05


def encode_cost_s(w: WorkerView, image_hashes: list[str], holders: Mapping[str, set[str]]) -> float:
    """Estimated seconds until `w` has sent every image's embeddings.

    An image `w` holds (its own L1) or its host holds (the shared L2) costs a read; the others cost
    a vision forward each at `w`'s measured rate. A request whose images are all held skips the
    encode queue on the worker (roles/encode.py), so it waits at most for the forward in progress;
    one with a miss waits behind everything queued there."""
    per_image = w.encode_s_per_image or DEFAULT_ENCODE_S_PER_IMAGE
    mine = {w.worker_id, host_member(w.host_id)} if w.host_id else {w.worker_id}
    misses = sum(1 for h in image_hashes if not (holders.get(h, set()) & mine))
    if misses == 0:
        return per_image * min(w.busy, 1.0)
    return per_image * (w.busy + misses)


def route_encode(workers: Iterable[WorkerView], image_hashes: list[str],
                 holders: Mapping[str, set[str]]) -> WorkerView | None:
    """The encode worker that will have the request's embeddings soonest (encode_cost_s): a holder
    while reading back beats encoding again elsewhere, an idle worker once the holders are backed up."""
    candidates = alive(workers, "encode")
    if not candidates:
        return None
    return min(candidates, key=lambda w: (encode_cost_s(w, image_hashes, holders), w.busy, w.worker_id))


def spread_encode(primary: WorkerView, workers: Iterable[WorkerView], image_hashes: list[str],
                  holders: Mapping[str, set[str]]) -> list[tuple[WorkerView, list[int]]]:
    """Share a request's images among idle encode workers: [(worker, image indices)], `primary` first.

    `primary` (route_encode's choice) keeps every image it or its host already holds. The images it
    would have to encode are dealt in turn to it and to the idle encoders (nothing open, nothing
    queued), so two misses on two idle encoders take one forward's time, not two. One part when
    fewer than two images miss or no other encoder is idle (today's single-encoder stage)."""
    mine = {primary.worker_id, host_member(primary.host_id)} if primary.host_id else {primary.worker_id}
    misses = [i for i, h in enumerate(image_hashes) if not (holders.get(h, set()) & mine)]
    idle = sorted((w for w in alive(workers, "encode") if w.worker_id != primary.worker_id and w.busy == 0),
                  key=lambda w: (w.encode_s_per_image or DEFAULT_ENCODE_S_PER_IMAGE, w.worker_id))
    if len(misses) < 2 or not idle:
        return [(primary, list(range(len(image_hashes))))]
    helpers = idle[: len(misses) - 1]
    parts: dict[str, list[int]] = {w.worker_id: [] for w in [primary, *helpers]}
    order = [primary, *helpers]
    for n, i in enumerate(misses):
        parts[order[n % len(order)].worker_id].append(i)
    parts[primary.worker_id] += [i for i in range(len(image_hashes)) if i not in misses]
    return [(w, sorted(parts[w.worker_id])) for w in order]


def route_prefill(workers: Iterable[WorkerView], prompt_tokens: int,
                  prefix_hits: Mapping[str, int] | None = None,
                  block_size: int = DEFAULT_ENGINE.block_size) -> WorkerView | None:
    """Least pending prefill work, less the tokens a worker already holds as cached prefix blocks."""
    candidates = alive(workers, "prefill")
    if not candidates:
        return None
    hits = prefix_hits or {}

    def cost(w: WorkerView) -> tuple[float, str]:
        saved = hits.get(w.worker_id, 0) * block_size
        return (w.inflight_tokens + prompt_tokens - saved + 64 * w.queue_len, w.worker_id)

    return min(candidates, key=cost)


def route_local_prefill(prefill: WorkerView, workers: Iterable[WorkerView], prompt_tokens: int, blocks_needed: int,
                        backlog_tokens: int) -> WorkerView | None:
    """A decode worker to prefill this prompt on and decode it there (conditional disaggregation), or
    None: the prefill worker routing chose keeps it.

    Only when that prefill worker already has at least `backlog_tokens` prompt tokens waiting (0: never;
    the coordinator's local_prefill_tokens), and a decode worker with room for the whole request has
    fewer prompt tokens of its own waiting than the prefill worker would with this one: a prefill pool
    that falls behind its decode pool lends it prompts, instead of every request queueing at prefill
    while the decode workers run small batches. Among those, the least busy."""
    if backlog_tokens <= 0 or prefill.inflight_tokens < backlog_tokens:
        return None
    ahead = prefill.inflight_tokens + prompt_tokens
    fits = [w for w in alive(workers, "decode") if (w.total_blocks == 0 or w.spare_blocks >= blocks_needed)
            and w.inflight_tokens + prompt_tokens < ahead]
    return min(fits, key=lambda w: (w.inflight_tokens, w.busy, w.worker_id), default=None)


def route_lend_adaptive(prefill: WorkerView, workers: Iterable[WorkerView], prompt_tokens: int,
                        blocks_needed: int) -> WorkerView | None:
    """A decode worker to prefill this prompt on and decode it there, or None: lent only where the time the
    prompt saves exceeds the time it costs the requests already on that decode worker.

    Both sides are counted in prompt tokens of compute, so no rate is needed (the prefill and decode
    workers run the same model on the same kind of cores): on the prefill worker this prompt waits for
    the `inflight_tokens` queued there; on decode worker `w` for `w.inflight_tokens`; the gain is the
    difference. Its own `prompt_tokens` of compute, run in `w`'s steps, hold back every request `w` holds
    (coordinator-assigned or reported, whichever is more): the cost is their number times the prompt.
    So a decode worker that is busy (the decode-heavy regime, where lending cost 9-27 % of throughput) is
    lent nothing, while prompts queue at a prefill pool that is behind (where lending cut the image
    tail from ~9 s to ~2.4 s) go where they start soonest (bench/README.md, "Adaptive lending")."""
    best, best_margin = None, 0
    for w in alive(workers, "decode"):
        if w.total_blocks and w.spare_blocks < blocks_needed:
            continue
        held = max(w.inflight, w.running + w.queue_len)
        margin = (prefill.inflight_tokens - w.inflight_tokens) - held * prompt_tokens
        if margin > best_margin or (best is not None and margin == best_margin and w.worker_id < best.worker_id):
            best, best_margin = w, margin
    return best


def prefix_covered(ends: Sequence[int | None], prompt_tokens: int, hit_blocks: int, block_size: int) -> list[int]:
    """The images (by index) whose whole placeholder range, ending at `ends[i]` (None: never skipped), lies
    in the `hit_blocks` leading prompt blocks a prefill worker holds: it needs no embeddings for them.
    A worker never reuses the block holding the prompt's last token, so neither does this count: both
    rules are common/prefix_rules.py's, as the worker's own skip (workers/prefix_skip.py)."""
    return covered(ends, min(hit_blocks, reusable_blocks(prompt_tokens, block_size)) * block_size)


def route_decode(workers: Iterable[WorkerView], blocks_needed: int) -> WorkerView | None:
    """The decode worker with the most spare KV blocks; among those that fit, the least busy."""
    candidates = alive(workers, "decode")
    if not candidates:
        return None
    fitting = [w for w in candidates if w.total_blocks == 0 or w.spare_blocks >= blocks_needed]
    if fitting:
        return min(fitting, key=lambda w: (w.busy, -w.spare_blocks, w.worker_id))
    return max(candidates, key=lambda w: (w.spare_blocks, -w.busy, w.worker_id))


def route_unified(workers: Iterable[WorkerView], prompt_tokens: int = 0,
                  prefix_hits: Mapping[str, int] | None = None,
                  block_size: int = DEFAULT_ENGINE.block_size) -> WorkerView | None:
    """Least pending work, less the prompt tokens a worker already holds as cached prefix blocks (as
    route_prefill), its running sequences counted too: a unified worker decodes them between prefills."""
    candidates = alive(workers, "unified")
    if not candidates:
        return None
    hits = prefix_hits or {}

    def cost(w: WorkerView) -> tuple[float, float, str]:
        saved = min(hits.get(w.worker_id, 0) * block_size, prompt_tokens)
        return (w.inflight_tokens + prompt_tokens - saved + 64 * (w.queue_len + w.running), w.busy, w.worker_id)

    return min(candidates, key=cost)


def pipeline_for(workers: Iterable[WorkerView], has_images: bool) -> str | None:
    """'disagg' when every pool the request needs is up, else 'unified', else None (wait)."""
    ws = list(workers)
    roles = {w.role for w in ws if w.alive}
    needed = {"prefill", "decode"} | ({"encode"} if has_images else set())
    if needed <= roles:
        return "disagg"
    if "unified" in roles:
        return "unified"
    return None
