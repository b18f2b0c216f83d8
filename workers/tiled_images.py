"""Vision inputs and per-image features for families that cut an image into tiles (InternVL, SmolVLM, Idefics3).

Their image processors batch tiles, not images, and their `get_image_features` returns features per
tile (InternVL) or per batch sample (SmolVLM): this module gives the runner one tensor per image,
its tiles' tokens in prompt order, so the generic scatter fills that image's placeholders in order.
"""

from __future__ import annotations

from typing import Any

import torch


def features_per_image(pooler_output: Any, inputs: Any, hidden_size: int) -> list[torch.Tensor]:
    """One [visual tokens, hidden] tensor per image. InternVL's features are one entry per tile and
    `num_patches` says how many consecutive tiles (thumbnail last) each image has."""
    num_patches = inputs.get("num_patches")
    if num_patches is not None:
        counts = [int(n) for n in (num_patches.tolist() if hasattr(num_patches, "tolist") else num_patches)]
        assert sum(counts) == len(pooler_output), (counts, len(pooler_output))
        return [t.reshape(-1, hidden_size) for t in torch.split(pooler_output, counts)]
    return [e.reshape(-1, hidden_size) for e in pooler_output]
