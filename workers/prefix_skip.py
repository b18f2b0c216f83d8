"""Images a request need not encode: those whose whole placeholder range its cached prefix already holds.

A prefix-cached image's K/V is in the pool, so its embeddings are never read; vLLM's scheduler likewise
runs the encoder only for the placeholder ranges it must compute. Such an image is *deferred*: its
embeddings stay missing (Sequence.deferred) until the request needs them after all, when the prefix
blocks were evicted before admission or the request was preempted. Then the engine encodes it itself
when it has the image (unified), or reports it (prefill, decode) so the coordinator encodes it again.
"""

from __future__ import annotations

from typing import Any, Sequence

from mserve.common import prefix_rules
from mserve.common.audio import AudioPart
from mserve.common.hashing import ImageSpan, prompt_block_hashes
from mserve.common.images import image_size_from_header
from mserve.workers.block_pool import BlockPool
from mserve.workers.sequence import Sequence as Seq, SeqStatus

# The FAILED message's lead words when a request's skipped images are needed after all and only a
# re-run with its images encoded can bring them (the coordinator's restart then encodes every image).
PREFIX_SKIP_MISSED = "prefix blocks evicted"


def cached_tokens(pool: BlockPool, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  spans: Sequence[ImageSpan]) -> int:
    """Leading tokens of a request whose K/V the pool holds now: what its admission would reuse."""
    hashes = prompt_block_hashes(list(prompt_ids), pool.block_size, list(spans))
    tokens = list(prompt_ids) + list(output_ids)
    return len(pool.reusable_prefix(hashes, tokens, len(tokens))) * pool.block_size


def covered(spans: Sequence[ImageSpan], cached: int) -> list[int]:
    """Indices of the spans wholly inside the first `cached` tokens (a partly covered one is not), by
    common/prefix_rules.py's rule, the one the coordinator's routing.prefix_covered applies."""
    return prefix_rules.covered([s.end for s in spans], cached)


def covered_images(pool: BlockPool, family: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
                   runs: Sequence[tuple[int, int]], images: Sequence[Any], hashes: Sequence[str]) -> dict[int, Any]:
    """The images (bytes) and audio clips (AudioPart), one placeholder run each, whose whole run the pool's
    cached prefix holds now: {item: its (t, h, w) grid on an M-RoPE family, else None}. Videos, and an
    item whose grid cannot be known without decoding it, are always encoded."""
    if len(runs) != len(images) or any(not isinstance(im, (bytes, AudioPart)) for im in images):
        return {}
    spans = [ImageSpan(start, length, h) for (start, length), h in zip(runs, hashes)]
    out: dict[int, Any] = {}
    for i in covered(spans, cached_tokens(pool, prompt_ids, output_ids, spans)):
        grid = None
        if family.uses_mrope:
            if not isinstance(images[i], bytes):
                continue
            grid = family.image_grid(image_size_from_header(images[i]))
            if grid is None or grid[0] * grid[1] * grid[2] // family.merge_size ** 2 != spans[i].length:
                continue
        out[i] = grid
    return out


def needed(seq: Seq, pool: BlockPool) -> list[int]:
    """The deferred items of `seq` whose embeddings its next computation reads: some placeholder run
    of theirs lies past what it has computed (running) or what its admission would reuse (waiting)."""
    if not seq.deferred:
        return []
    if seq.status is SeqStatus.RUNNING:
        done = seq.num_computed_tokens
    else:
        done = len(pool.reusable_prefix(seq.prompt_hashes(pool.block_size), seq.token_ids, seq.num_tokens)) \
            * pool.block_size
    return [item for item in seq.deferred if any(seq.images[r].end > done for r in seq.awaiting.get(item, ()))]

