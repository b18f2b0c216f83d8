"""The masks paged attention applies beyond the causal one, each as transformers builds it for the model.

An image's tokens attending to each other both ways (HF's blockwise overlay over token_type_ids groups:
Gemma 3, Gemma 4), and the keys a layer's locality hides: a sliding window (sliding_window_overlay) or an
attention chunk (chunked_overlay: Llama 4's local layers). workers/paged_attention.py combines them with
the causal mask per attention group.
"""

from __future__ import annotations

from typing import Sequence

import torch


def same_image(chunks: Sequence[tuple], num_keys: int, query_pos: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[G, max_q, keys]: True where query and key are tokens of one image (HF's blockwise_overlay over
    token_type_ids groups). The scheduler computes an image in one chunk, so all its keys are written."""
    key_image = torch.full((len(chunks), num_keys), -1, dtype=torch.long, device=device)
    for i, c in enumerate(chunks):
        for k, (lo, hi) in enumerate(c[4]):
            key_image[i, lo:hi] = k
    query_image = key_image.gather(1, query_pos)
    return (query_image[:, :, None] == key_image[:, None, :]) & (query_image[:, :, None] >= 0)


def local_keys(query_pos: torch.Tensor, num_keys: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """[G, max_q, keys]: True where a key is within the query's sliding window, as transformers'
    sliding_window_overlay (key > query - window), and in the query's own attention chunk, as its
    chunked_overlay (key // chunk == query // chunk, with the causal mask: key >= query // chunk * chunk).
    Applied after an image group's bidirectional part, as in HF's Gemma 3."""
    key_pos = torch.arange(num_keys, device=query_pos.device)[None, None, :]
    query_pos = query_pos[:, :, None]
    near = torch.ones((*query_pos.shape[:2], num_keys), dtype=torch.bool, device=query_pos.device)
    if window is not None:
        near &= key_pos > query_pos - window
    if chunk is not None:
        near &= key_pos >= query_pos // chunk * chunk
    return near
