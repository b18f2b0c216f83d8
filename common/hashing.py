"""Chained KV block hashes: the one key a prefill worker's pool and the cluster's prefix index share.

Pure Python, no torch. A block's hash chains its parent's hash with its token ids and the images it
overlaps (image hash + offset), so identical placeholder ids of two different images never collide.
The coordinator computes these to look up prefix affinity; the workers' block pools key on them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import msgpack


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in a prompt, and whose image it is."""

    start: int
    length: int
    image_hash: str

    @property
    def end(self) -> int:
        return self.start + self.length


def item_spans(runs: Sequence[tuple[int, int]], items: Sequence[tuple[str, int]]) -> list[ImageSpan]:
    """One ImageSpan per placeholder run (start, length), given the request's images and videos as (hash,
    visual tokens) in prompt order. An item covers one run, or consecutive runs whose lengths add up to its
    tokens (a video given to LLaVA as frames: one run per frame), each keyed "{hash}/{frame}". ValueError
    when they do not line up."""
    spans: list[ImageSpan] = []
    r = 0
    for i, (key, tokens) in enumerate(items):
        group, covered = [], 0
        while covered < tokens and r < len(runs):
            group.append(runs[r])
            covered += runs[r][1]
            r += 1
        if covered != tokens:
            raise ValueError(f"item {i} has {tokens} visual tokens but its placeholder runs hold {covered}")
        if len(group) == 1:
            spans.append(ImageSpan(group[0][0], group[0][1], key))
        else:
            spans.extend(ImageSpan(start, n, f"{key}/{k}") for k, (start, n) in enumerate(group))
    if r != len(runs):
        raise ValueError(f"{len(runs) - r} placeholder runs are left without an image")
    return spans


def block_hash(parent: str | None, token_ids: Sequence[int], extra: Sequence[tuple[str, int]] = ()) -> str:
    """Chained hash of one full block, stable across processes (it is shared through Redis).

    `extra` holds (image hash, offset of this block inside the image) for each image the block
    overlaps: identical placeholder ids of two different images must never collide.
    """
    payload = msgpack.packb([parent or "", list(token_ids), [list(e) for e in extra]])
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def block_extra_keys(start: int, end: int, images: Sequence[ImageSpan]) -> list[tuple[str, int]]:
    return [(im.image_hash, start - im.start) for im in images if im.start < end and start < im.end]


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, images: Sequence[ImageSpan] = ()) -> list[str]:
    """Hashes of every full block of `token_ids`, each chained on the previous one."""
    hashes: list[str] = []
    parent: str | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parent = block_hash(parent, token_ids[start:end], block_extra_keys(start, end, images))
        hashes.append(parent)
    return hashes


def host_member(host_id: str) -> str:
    """How the Redis embedding index names a host's shared (L2) cache as a holder of an image."""
    return f"host:{host_id}"
