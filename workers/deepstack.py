"""DeepStack (Qwen3-VL): extra visual features the language model adds to image tokens after its first layers.

Qwen3-VL's vision tower returns, besides each image's embeddings, the merged features of a few of its
blocks (`deepstack_features`); its text model adds feature k to the hidden states of the image-token
positions after decoder layer k. Here they ride as extra columns of the image's embeddings tensor,
[tokens, hidden * (1 + layers)]: every path that moves, caches or slices an image's rows (the transfer,
the L1/L2 embedding caches, chunked prefill, a KV export) carries them with no change, and token counts
(rows) stay what they are. Prefill splits them off again and hands the text model the rows of the
positions it computes in this step, so a chunk holding part of an image gets that part's features.
"""

from __future__ import annotations

from typing import Sequence

import torch


def deepstack_layers(model: torch.nn.Module) -> int:
    """How many DeepStack features the checkpoint's tower makes (0: none, every other family)."""
    vision = getattr(model.config, "vision_config", None)  # an audio-only family (Qwen2-Audio) has none
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def pack(embeds: Sequence[torch.Tensor], features: Sequence[Sequence[torch.Tensor]] | None) -> list[torch.Tensor]:
    """Each image's embeddings with its DeepStack features (one per layer, split per image) as extra columns."""
    if not features:
        return list(embeds)
    return [torch.cat([e, *(layer[i].reshape(e.shape[0], -1) for layer in features)], dim=1)
            for i, e in enumerate(embeds)]


class DeepstackRows:
    """The DeepStack inputs of one packed forward: which rows are visual, and their features per layer."""

    def __init__(self, hidden: int, layers: int) -> None:
        self.hidden, self.layers = hidden, layers
        self.positions: list[int] = []
        self.rows: list[torch.Tensor] = []  # [n, hidden * layers] per scattered piece

    def add(self, dst: int, image_rows: torch.Tensor) -> None:
        """`image_rows` (packed columns) go to packed positions dst, dst + 1, ... (in increasing order)."""
        self.positions.extend(range(dst, dst + image_rows.shape[0]))
        self.rows.append(image_rows[:, self.hidden :])

    def kwargs(self, num_tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The text model's visual_pos_masks / deepstack_visual_embeds ({} when no visual row runs)."""
        if not self.positions:
            return {}
        mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=device)
        mask[0, torch.tensor(self.positions, device=device)] = True
        feats = torch.cat(self.rows).to(device, dtype)
        return {"visual_pos_masks": mask,
                "deepstack_visual_embeds": list(feats.split(self.hidden, dim=1))}
