"""Families whose image tokens attend to each other both ways (Gemma 3): no prefill chunk and no reused
cached prefix ends inside an image. Pure scheduling, no model."""

from __future__ import annotations

from mserve.common.hashing import ImageSpan
from mserve.workers.block_pool import BlockPool, BlockTable
from mserve.workers.image_bounds import chunk_end, usable_prefix_blocks
from mserve.workers.scheduler import Scheduler
from mserve.workers.sequence import SamplingParams, Sequence

IMAGES = [ImageSpan(5, 16, "a"), ImageSpan(30, 16, "b")]  # tokens [5, 21) and [30, 46) of a 60-token prompt


def image_seq(rid: str = "r") -> Sequence:
    ids = [100 + i for i in range(60)]
    for span in IMAGES:
        ids[span.start : span.end] = [7] * span.length
    return Sequence(request_id=rid, prompt_ids=ids, images=list(IMAGES), sampling=SamplingParams(max_tokens=2))


def chunks_until_first_token(sched: Scheduler) -> list[tuple[int, int]]:
    out = []
    while True:
        chunks = sched.schedule()
        assert chunks, "nothing scheduled"
        out.extend((c.start, c.num_tokens) for c in chunks)
        done = sum(c.completes_sequence for c in chunks)  # read before postprocess appends the token
        sched.postprocess(chunks, [9] * done)
        if done:
            return out


def test_chunks_end_at_image_bounds_only_for_whole_image_families():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=8, whole_images=True)
    sched.add(image_seq())
    # Cut back to an image's start; an image the budget cannot hold is taken whole (over budget by < 1 image).
    assert chunks_until_first_token(sched) == [(0, 5), (5, 16), (21, 8), (29, 1), (30, 16), (46, 8), (54, 6)]
    plain = Scheduler(BlockPool(64, 4), max_num_batched_tokens=8)
    plain.add(image_seq())
    assert chunks_until_first_token(plain) == [(s, 8) for s in range(0, 56, 8)] + [(56, 4)]


def test_chunk_end_never_inside_an_image():
    for start in range(0, 60):
        if any(s.start < start < s.end for s in IMAGES):
            continue  # a chunk never starts inside an image either
        for n in range(1, 61 - start):
            end = chunk_end(IMAGES, start, start + n)
            assert end > start and not any(s.start < end < s.end for s in IMAGES), (start, n, end)


def test_usable_prefix_is_cut_to_an_image_start():
    assert usable_prefix_blocks(IMAGES, 1, 4) == 1  # 4 tokens: before the first image
    assert usable_prefix_blocks(IMAGES, 3, 4) == 1  # 12 tokens end inside [5, 21): back to block 1 (5 // 4)
    assert usable_prefix_blocks(IMAGES, 6, 4) == 6  # 24 tokens: between the images
    assert usable_prefix_blocks(IMAGES, 9, 4) == 7  # 36 inside [30, 46): 30 // 4
    assert usable_prefix_blocks([], 9, 4) == 9


def test_cached_prefix_hit_is_cut_back_to_an_image_bound():
    """The first request's tail blocks are evicted so its cached prefix ends inside the first image:
    the same prompt again reuses only the blocks before that image."""
    pool = BlockPool(16, 4)
    sched = Scheduler(pool, max_num_batched_tokens=64, whole_images=True)
    first = image_seq("first")
    sched.add(first)
    chunks_until_first_token(sched)
    sched.finish(first, "stop")
    sched.free(first)
    # Evict all but the prompt's first 3 cached blocks (12 tokens, inside the image at [5, 21)).
    scratch = BlockTable()
    pool.allocate(scratch, (pool.num_free_blocks - 3) * 4)
    pool.free(scratch)
    again = image_seq("again")
    sched.add(again)
    assert chunks_until_first_token(sched) == [(4, 56)]  # one block reused (not 3: 12 is inside the image)
    assert again.num_cached_tokens == 4
    pool.check_integrity()
