"""Prompt prefixes this coordinator has just sent to a worker: cache affinity before Redis knows.

Workers publish the prefix blocks they hold to the Redis index at most once a heartbeat
(workers/cache_index.py). A conversation's next turn is often sent the moment the previous one
ends, before that publish: routed on Redis alone it looks like a miss everywhere, goes to the least
loaded worker and computes the whole conversation again there. The coordinator knows where it sent
each prompt, so it remembers the block hashes of the last prompts it routed to a prefill or unified
worker and credits them like the Redis index does. Pure: no I/O.

For routing, a stale entry (the worker evicted the blocks) costs no more than a stale Redis entry: the
worker counts its real hits itself. Not so for skipping an encode (routing.prefix_covered): a PREFILL
whose skipped images' blocks are gone fails and the request runs again with every image encoded. This
memory never hears of evictions, while the Redis index does within a heartbeat, so the skip trusts an
entry only for SKIP_HORIZON_S after its prompt was sent (`match(..., since=)`); later the index says.
Without the horizon, a cluster whose prefill pool had turned over ran every repeated image prompt
twice (100 re-runs in 102 requests of a repeated trace, `mserve status`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

from mserve.common.prefix_rules import leading_run

DEFAULT_CAPACITY = 1 << 16  # block hashes remembered (about 1M prompt tokens at 16 tokens a block)
# How long after a prompt was sent an encode skip trusts this memory: many heartbeats (a worker's index
# publish, 0.25 s by default), so by then the Redis index holds the worker's adds and evictions.
SKIP_HORIZON_S = 5.0


class RecentPrefixes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[str, dict[str, float]] = OrderedDict()  # hash -> {worker: when sent}

    def __len__(self) -> int:
        return len(self._holders)

    def placed(self, hashes: Iterable[str], worker_id: str, now: float = 0.0) -> None:
        """`worker_id` was sent a prompt whose full blocks hash to `hashes` at `now`: it will hold them."""
        for h in hashes:
            holders = self._holders.pop(h, {})
            holders[worker_id] = now
            self._holders[h] = holders
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """A worker left (or restarted empty): it holds none of them."""
        for h in [h for h, holders in self._holders.items() if holders.pop(worker_id, None) is not None and not holders]:
            del self._holders[h]

    def match(self, hashes: Sequence[str], since: float | None = None) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it was sent (>= 1), as
        RedisStore.match_prefix; with `since`, counting only what it was sent at or after then."""
        def holders(h: str) -> set[str]:
            sent = self._holders.get(h, {})
            return {w for w, at in sent.items() if since is None or at >= since}

        return leading_run(holders(h) for h in hashes)


def merge_hits(*sources: Mapping[str, int]) -> dict[str, int]:
    """Per worker, the longest leading run any source credits it with."""
    merged: dict[str, int] = {}
    for hits in sources:
        for w, n in hits.items():
            merged[w] = max(merged.get(w, 0), n)
    return merged
