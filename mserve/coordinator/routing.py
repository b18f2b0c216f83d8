"""Routing policy: which worker of a role takes the next stage of a request. Pure Python, no sockets.

Inputs are the coordinator's view of each worker (liveness, the load it reports through Redis and
heartbeats, and the stages the coordinator has handed it but not yet seen finish) plus cache
affinity. Text-only requests skip encode; an image already encoded somewhere goes back there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass
class WorkerView:
    worker_id: str
    role: str
    alive: bool = True
    queue_len: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0
    rss_mib: float = 0.0  # the worker process's resident memory, and what it holds:
    weights_mib: float = 0.0
    kv_pool_mib: float = 0.0
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


def route_encode(workers: Iterable[WorkerView], image_hashes: list[str],
                 holders: Mapping[str, set[str]]) -> WorkerView | None:
    """The encode worker holding most of the request's images; ties go to the least busy."""
    candidates = alive(workers, "encode")
    if not candidates:
        return None

    def score(w: WorkerView) -> tuple[int, float, str]:
        hits = sum(1 for h in image_hashes if w.worker_id in holders.get(h, ()))
        return (-hits, w.busy, w.worker_id)

    return min(candidates, key=score)


def route_prefill(workers: Iterable[WorkerView], prompt_tokens: int,
                  prefix_hits: Mapping[str, int] | None = None, block_size: int = 16) -> WorkerView | None:
    """Least pending prefill work, less the tokens a worker already holds as cached prefix blocks."""
    candidates = alive(workers, "prefill")
    if not candidates:
        return None
    hits = prefix_hits or {}

    def cost(w: WorkerView) -> tuple[float, str]:
        saved = hits.get(w.worker_id, 0) * block_size
        return (w.inflight_tokens + prompt_tokens - saved + 64 * w.queue_len, w.worker_id)

    return min(candidates, key=cost)


def route_decode(workers: Iterable[WorkerView], blocks_needed: int) -> WorkerView | None:
    """The decode worker with the most spare KV blocks; among those that fit, the least busy."""
    candidates = alive(workers, "decode")
    if not candidates:
        return None
    fitting = [w for w in candidates if w.total_blocks == 0 or w.spare_blocks >= blocks_needed]
    if fitting:
        return min(fitting, key=lambda w: (w.busy, -w.spare_blocks, w.worker_id))
    return max(candidates, key=lambda w: (w.spare_blocks, -w.busy, w.worker_id))


def route_unified(workers: Iterable[WorkerView]) -> WorkerView | None:
    candidates = alive(workers, "unified")
    return min(candidates, key=lambda w: (w.busy, w.worker_id)) if candidates else None


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
