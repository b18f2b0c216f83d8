"""Paged-KV block accounting: which block holds which tokens, who shares it, and what can be reused.

Pure Python (no torch): the tensors live in `workers/paged_attention.py` (KVCache); this module only hands out block
ids. Full blocks carry a chained hash (parent hash + token ids + the images they overlap), so a
later prompt with the same prefix finds them again (prefix reuse) and a cluster can index them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mserve.common.hashing import ImageSpan, block_extra_keys, block_hash
from mserve.common.policy import blocks_for
from mserve.common.prefix_rules import reusable_blocks


class OutOfBlocks(RuntimeError):
    """Raised when a request needs more KV blocks than the pool can free."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: str | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockTable:
    """One request's blocks in order, and how many of its leading tokens are hashed."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)


class BlockPool:
    """Hands out fixed-size KV blocks with ref counts, lazy-LRU reuse of freed hashed blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_end_ok: Callable[[str], bool] | None = None) -> None:
        """`prefix_end_ok(hash)`: whether a reused prefix may end after the block of that hash (a hybrid
        model needs its linear layers' state snapshot there, workers/linear_state.py); None: anywhere."""
        assert num_blocks > 0 and block_size > 0
        self.prefix_end_ok = prefix_end_ok
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (oldest first). Freed hashed blocks go to the tail so the
        # most recently used prefixes survive longest; a cache hit is pulled out in O(1).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[str, int] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.evictions = 0
        # What the cluster's prefix index must learn, oldest first: hash -> True (now held here) or
        # False (evicted). Last word wins, so a hash evicted and cached again reads True. A worker
        # drains it (take_index_changes) into Redis; bounded in case nobody does.
        self._index_changes: OrderedDict[str, bool] = OrderedDict()
        self.index_changes_dropped = 0

    def _note(self, h: str, held: bool) -> None:
        self._index_changes.pop(h, None)
        self._index_changes[h] = held
        if len(self._index_changes) > 8 * self.num_blocks:
            self._index_changes.popitem(last=False)
            self.index_changes_dropped += 1

    def take_index_changes(self) -> dict[str, bool]:
        """The index changes since the last call (hash -> held), and forget them."""
        out, self._index_changes = dict(self._index_changes), OrderedDict()
        return out

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].hash is not None)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- allocation ---------------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if not self._free:
            raise OutOfBlocks(f"KV pool exhausted: all {self.num_blocks} blocks of {self.block_size} tokens are in use")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the stale prefix this block held
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
                self._note(block.hash, False)
                self.evictions += 1
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def match_prefix(self, hashes: Sequence[str], token_ids: Sequence[int]) -> list[int]:
        """Block ids already holding the leading full blocks of a prompt (no ref taken)."""
        found: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            # Re-check the tokens: a hash is a claim, the token ids are the proof.
            expected = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != expected:
                break
            found.append(block_id)
        return found

    def reusable_prefix(self, hashes: Sequence[str], token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks a sequence of `num_tokens` tokens may start from: its leading full blocks
        found in the pool (match_prefix), never the one holding its last token, whose logits must be
        computed. No reference is taken: hand the answer to `allocate` before anything else allocates."""
        found = self.match_prefix(hashes[:reusable_blocks(num_tokens, self.block_size)], token_ids)
        if self.prefix_end_ok is not None:
            while found and not self.prefix_end_ok(hashes[len(found) - 1]):
                found.pop()
        return found

    def num_idle(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` sit unreferenced in the free list: reusing them takes them out of it."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def allocate(self, table: BlockTable, num_tokens: int, prefix: Sequence[int] | None = None) -> int:
        """Grow `table` to cover `num_tokens`; an empty `table` starts from the cached `prefix` blocks
        (reusable_prefix's answer; None when no prefix was looked up, which the counters tell apart).

        Returns the number of leading tokens whose K/V is already in the pool (prefix hits).
        Raises OutOfBlocks, leaving `table` unchanged, when the pool cannot cover the request.
        """
        cached: list[int] = []
        if not table.block_ids and prefix is not None:
            self.prefix_queries += 1
            cached = list(prefix)
        needed = self.blocks_needed(num_tokens) - len(table.block_ids) - len(cached)
        reusable_free = self.num_idle(cached)
        if needed > len(self._free) - reusable_free:
            raise OutOfBlocks(
                f"KV pool exhausted: need {needed} more blocks of {self.block_size} tokens, "
                f"{len(self._free) - reusable_free} free of {self.num_blocks}"
            )
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.block_ids.append(block_id)
            table.hashes.append(block.hash)  # type: ignore[arg-type]
        if cached:
            self.prefix_hits += 1
        # The same blocks as taken one by one, in ascending order: free() returns a request's blocks
        # last first, so the free list holds runs of descending ids, and attention reads a table front to
        # back, quicker where its blocks follow each other in memory (the decode kernel: 5.0-5.5 ms a step
        # over runs counting down, 3.3-4.3 in order; bench/lab/NOTEBOOK.md, "bf16 on the CPU").
        table.block_ids.extend(sorted(self._take_free_block().block_id for _ in range(needed)))
        return len(cached) * self.block_size

    def commit_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int,
                           images: Sequence[ImageSpan] = ()) -> list[str]:
        """Hash the blocks that became full (their K/V written) so later prompts can reuse them.

        Returns the new hashes (also noted for the cluster's prefix index: take_index_changes).
        """
        new: list[str] = []
        full = min(num_computed // self.block_size, len(table.block_ids))
        while len(table.hashes) < full:
            i = len(table.hashes)
            start, end = i * self.block_size, (i + 1) * self.block_size
            parent = table.hashes[-1] if table.hashes else None
            h = block_hash(parent, token_ids[start:end], block_extra_keys(start, end, images))
            table.hashes.append(h)
            block = self.blocks[table.block_ids[i]]
            if block.hash is None and h not in self._hash_to_block:
                block.hash, block.token_ids = h, tuple(token_ids[start:end])
                self._hash_to_block[h] = block.block_id
                self._note(h, True)
                new.append(h)
        return new

    def free(self, table: BlockTable) -> None:
        """Drop one reference to each block of `table`; unreferenced blocks become reusable."""
        # Reverse order: the tail of a prompt is the least likely to be shared, so evict it first.
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)  # uncached: reuse first
                else:
                    self._free[block_id] = None
        table.block_ids.clear()
        table.hashes.clear()

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + used == total, and every index entry points at a block holding that hash."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(self._free) == self.num_blocks, "free + used != total"
        for b in self._free:
            assert self.blocks[b].ref_count == 0, f"free block {b} still referenced"
        for h, b in self._hash_to_block.items():
            assert self.blocks[b].hash == h, f"hash index points block {b} at a stale hash"
        cached = sum(1 for b in self._free if self.blocks[b].hash is not None)
        assert self.num_cached_blocks == cached and cached <= len(self._free)

    def cached_hashes(self) -> list[str]:
        """Hashes of every block that holds a reusable prefix (in use or cached)."""
        return list(self._hash_to_block)

    def stats(self) -> dict[str, int]:
        return {
            "total_blocks": self.num_blocks,
            "free_blocks": self.num_free_blocks,
            "cached_blocks": self.num_cached_blocks,
            "used_blocks": self.num_used_blocks,
            "prefix_hits": self.prefix_hits,
            "prefix_queries": self.prefix_queries,
            "indexed_blocks": len(self._hash_to_block),
            "prefix_evictions": self.evictions,
        }
