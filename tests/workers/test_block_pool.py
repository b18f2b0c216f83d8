"""Block accounting without a model: allocation, ref counts, hash chain, lazy-LRU reuse, integrity."""

from __future__ import annotations

import pytest

from mserve.common.hashing import ImageSpan, block_hash, prompt_block_hashes
from mserve.workers.block_pool import BlockPool, BlockTable, OutOfBlocks


def allocate_prompt(pool: BlockPool, tokens: list[int], images=()) -> tuple[BlockTable, int]:
    table = BlockTable()
    hashes = prompt_block_hashes(tokens, pool.block_size, images)
    cached = pool.allocate(table, len(tokens), pool.reusable_prefix(hashes, tokens, len(tokens)) if hashes else None)
    pool.commit_full_blocks(table, tokens, len(tokens), images)
    return table, cached


def test_allocate_and_free_restore_every_block():
    pool = BlockPool(num_blocks=8, block_size=4)
    table = BlockTable()
    assert pool.allocate(table, 10) == 0
    assert len(table.block_ids) == 3 and pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.allocate(table, 13)  # grows by one block
    assert len(table.block_ids) == 4
    pool.check_integrity()
    pool.free(table)
    assert pool.num_free_blocks == 8 and table.block_ids == []
    pool.check_integrity()


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable()
    pool.allocate(table, 12)
    other = BlockTable()
    with pytest.raises(OutOfBlocks, match=r"need 2 more blocks of 4 tokens, 1 free of 4"):
        pool.allocate(other, 8)
    assert other.block_ids == [] and pool.num_free_blocks == 1
    pool.check_integrity()


def test_hash_chain_depends_on_every_earlier_block_and_on_images():
    a = prompt_block_hashes(list(range(12)), 4)
    b = prompt_block_hashes([99] + list(range(1, 12)), 4)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later hash
    assert prompt_block_hashes(list(range(11)), 4) == a[:2]  # only full blocks are hashed
    img1 = prompt_block_hashes([5] * 8, 4, [ImageSpan(0, 8, "img-one")])
    img2 = prompt_block_hashes([5] * 8, 4, [ImageSpan(0, 8, "img-two")])
    assert img1 != img2  # identical placeholder ids of different images never collide
    assert block_hash(None, [1, 2], [("h", 0)]) != block_hash(None, [1, 2], [("h", 4)])  # offset matters


def test_prefix_reuse_shares_blocks_with_ref_counts():
    pool = BlockPool(num_blocks=10, block_size=4)
    tokens = list(range(14))
    first, cached = allocate_prompt(pool, tokens)
    assert cached == 0
    second, cached = allocate_prompt(pool, tokens)
    assert cached == 12  # three full blocks reused; the last partial block is computed
    assert second.block_ids[:3] == first.block_ids[:3]
    assert all(pool.blocks[b].ref_count == 2 for b in first.block_ids[:3])
    pool.free(first)
    assert all(pool.blocks[b].ref_count == 1 for b in second.block_ids[:3])
    pool.free(second)
    assert pool.num_free_blocks == 10 and pool.num_cached_blocks == 3
    pool.check_integrity()


def test_last_prompt_token_is_never_served_from_cache():
    pool = BlockPool(num_blocks=10, block_size=4)
    tokens = list(range(8))  # exactly two full blocks
    t1, _ = allocate_prompt(pool, tokens)
    pool.free(t1)
    _, cached = allocate_prompt(pool, tokens)
    assert cached == 4  # the block with the last token is recomputed so its logits exist


def test_freed_cached_blocks_are_evicted_last_and_hits_pulled_out():
    pool = BlockPool(num_blocks=4, block_size=2)
    kept, _ = allocate_prompt(pool, [1, 2, 3, 4, 5])  # 3 blocks, 2 hashed
    pool.free(kept)
    plain = BlockTable()
    pool.allocate(plain, 2)  # takes the uncached block first
    assert pool.num_cached_blocks == 2
    again, cached = allocate_prompt(pool, [1, 2, 3, 4, 5])
    assert cached == 4
    pool.check_integrity()


def test_eviction_drops_stale_hash():
    pool = BlockPool(num_blocks=2, block_size=2)
    t, _ = allocate_prompt(pool, [1, 2, 3])
    pool.free(t)
    grab = BlockTable()
    pool.allocate(grab, 4)  # needs both blocks: the cached one is evicted
    assert pool.num_cached_blocks == 0
    pool.free(grab)
    _, cached = allocate_prompt(pool, [1, 2, 3])
    assert cached == 0
    pool.check_integrity()


def test_a_turned_over_pool_still_hands_a_request_its_new_blocks_in_ascending_order():
    pool = BlockPool(num_blocks=12, block_size=2)
    first, _ = allocate_prompt(pool, list(range(1, 12)))  # blocks 0-5, five hashed
    second, _ = allocate_prompt(pool, list(range(100, 112)))  # blocks 6-11
    pool.free(first)
    pool.free(second)  # the free list now runs 5, 4, ..., 0, then 11, 10, ..., 6 (last block first)
    evicted_before = pool.evictions
    table = BlockTable()
    pool.allocate(table, 16)  # 8 blocks: the same ones, oldest first, as taken one by one
    assert table.block_ids == [0, 1, 2, 3, 4, 5, 10, 11]
    assert pool.evictions - evicted_before == 5 + 2  # the hashes they held are gone, as before
    pool.allocate(table, 20)  # growing keeps what it had in place
    assert table.block_ids[:8] == [0, 1, 2, 3, 4, 5, 10, 11] and len(table.block_ids) == 10
    pool.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=2, block_size=2)
    t = BlockTable()
    pool.allocate(t, 2)
    ids = list(t.block_ids)
    pool.free(t)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(BlockTable(block_ids=ids))


def test_a_cached_prefix_is_reused_while_the_image_it_runs_into_is_still_awaited():
    """The scheduler takes the blocks the pool found (reusable_prefix) even when no new token can run yet:
    an image straddling the end of the cached prefix has not arrived, so this step computes nothing."""
    from mserve.workers.scheduler import Scheduler
    from mserve.workers.sequence import SamplingParams, Sequence

    pool = BlockPool(num_blocks=16, block_size=4)
    tokens = list(range(100, 114))  # 14 tokens; the image's placeholders are 6..9, across blocks 1 and 2
    image = [ImageSpan(6, 4, "img")]
    done, _ = allocate_prompt(pool, tokens[:8], image)  # an earlier request left blocks 0 and 1 cached
    pool.free(done)
    scheduler = Scheduler(pool, enable_prefix_caching=True)
    seq = Sequence("late-image", tokens, sampling=SamplingParams(max_tokens=2), images=image, awaiting={0: [0]})
    scheduler.add(seq)
    assert scheduler.schedule() == []  # admitted with its cached prefix, nothing to compute until the image
    assert seq.num_cached_tokens == seq.num_computed_tokens == 8 and seq in scheduler.running
    assert seq.block_table.block_ids[:2] == pool.match_prefix(prompt_block_hashes(tokens, 4, image), tokens)
    assert pool.stats()["prefix_hits"] == 1 and pool.stats()["prefix_queries"] == 2
    pool.check_integrity()
