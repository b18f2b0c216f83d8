"""Where a prefill chunk or a reused cached prefix may end for families whose image tokens attend to
each other both ways (Gemma 3): never inside an image, so each image is computed in one forward and
its first tokens see its last ones. An audio clip's tokens attend causally (Gemma 4's audio beside its
images): a chunk may end inside one. Pure Python, no torch."""

from __future__ import annotations

from typing import Sequence

from mserve.common.hashing import ImageSpan


def bidirectional_spans(images: Sequence[ImageSpan], token_ids: Sequence[int],
                        causal_token: int | None) -> list[ImageSpan]:
    """The spans of `images` whose tokens attend both ways: all but the runs of `causal_token` (the audio
    token of a family whose images alone are bidirectional; HF's Gemma 4 groups image and video tokens only)."""
    return [s for s in images if causal_token is None or token_ids[s.start] != causal_token]


def chunk_end(images: Sequence[ImageSpan], start: int, end: int) -> int:
    """The end of a chunk [start, end) moved off any image it would cut: back to that image's start, or,
    when the chunk starts at the image (the budget is smaller than the image), on to the image's end,
    so the request still progresses (the step then runs over its token budget by under one image)."""
    for span in images:
        if span.start < end < span.end:
            return span.start if span.start > start else span.end
    return end


def usable_prefix_blocks(images: Sequence[ImageSpan], num_blocks: int, block_size: int) -> int:
    """How many of `num_blocks` leading cached blocks a request may start from without its computed
    prefix ending inside an image (the rest of that image is then computed whole, with its start)."""
    tokens = num_blocks * block_size
    for span in images:
        if span.start < tokens < span.end:
            return span.start // block_size
    return num_blocks
