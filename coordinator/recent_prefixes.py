"""Prompt prefixes this coordinator has just sent to a worker: cache affinity before Redis knows.

Workers publish the prefix blocks they hold to the Redis index at most once a heartbeat
(workers/cache_index.py). A conversation's next turn is often sent the moment the previous one
ends, before that publish: routed on Redis alone it looks like a miss everywhere, goes to the least
loaded worker and computes the whole conversation again there. The coordinator knows where it sent
each prompt, so it remembers the block hashes of the last prompts it routed to a prefill or unified
worker and credits them like the Redis index does. Pure: no I/O. A stale entry (the worker evicted
the blocks) costs no more than a stale Redis entry: the worker counts its real hits itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

DEFAULT_CAPACITY = 1 << 16  # block hashes remembered (about 1M prompt tokens at 16 tokens a block)


class RecentPrefixes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[str, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def placed(self, hashes: Iterable[str], worker_id: str) -> None:
        """`worker_id` was sent a prompt whose full blocks hash to `hashes`: it will hold them."""
        for h in hashes:
            holders = self._holders.pop(h, set())
            holders.add(worker_id)
            self._holders[h] = holders
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """A worker left (or restarted empty): it holds none of them."""
        for h in [h for h, holders in self._holders.items() if holders.discard(worker_id) is None and not holders]:
            del self._holders[h]

    def match(self, hashes: Sequence[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it was sent (>= 1), as RedisStore.match_prefix."""
        if not hashes or hashes[0] not in self._holders:
            return {}
        counts = dict.fromkeys(self._holders[hashes[0]], 1)
        active = set(counts)
        for h in hashes[1:]:
            active &= self._holders.get(h, set())
            if not active:
                break
            for w in active:
                counts[w] += 1
        return counts


def merge_hits(*sources: Mapping[str, int]) -> dict[str, int]:
    """Per worker, the longest leading run any source credits it with."""
    merged: dict[str, int] = {}
    for hits in sources:
        for w, n in hits.items():
            merged[w] = max(merged.get(w, 0), n)
    return merged
