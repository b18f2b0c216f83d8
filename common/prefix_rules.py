"""The prefix cache's three rules, written once for the coordinator and the workers.

Pure Python: the Redis prefix index (common/redis_indexes.py) and the coordinator's recent sends
(coordinator/recent_prefixes.py) count a chain's leading run the same way; a worker's block pool
(workers/block_pool.py) and the coordinator's routing (coordinator/routing.py) leave the same last
block out; the worker's encode skip (workers/prefix_skip.py) and routing's (routing.prefix_covered)
cover an image by the same test. Were any pair to disagree, the coordinator would skip an encode that
the worker then needs, or route by a hit the worker never reuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def leading_run(holders: Iterable[set[str]]) -> dict[str, int]:
    """For each holder of the chain's first block, how many leading blocks it holds (>= 1): a block counts
    only if every earlier block of the chain is held too. `holders` gives each block's holders in chain
    order; it is read lazily and no further than the longest run."""
    counts: dict[str, int] = {}
    active: set[str] | None = None
    for held in holders:
        active = set(held) if active is None else active & held
        if not active:
            break
        for w in active:
            counts[w] = counts.get(w, 0) + 1
    return counts


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a `num_tokens` sequence may come from the cache: never the one
    holding its last token, whose logits must be computed."""
    return max(0, (num_tokens - 1) // block_size)


def covered(ends: Sequence[int | None], cached_tokens: int) -> list[int]:
    """The images (by index) whose whole placeholder range, ending at `ends[i]` (exclusive; None: never
    covered), lies inside the first `cached_tokens` tokens. A partly covered image is not covered."""
    return [i for i, end in enumerate(ends) if end is not None and 0 < end <= cached_tokens]
