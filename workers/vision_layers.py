"""Drop the vision tower's layers whose output no image feature reads.

LLaVA-style checkpoints take image features from a hidden state inside the vision tower
(`vision_feature_layer`, -2 for LLaVA-1.5: the penultimate CLIP layer). The layers after the deepest
one read compute nothing that is used, on every image. They are dropped at load (vLLM builds its
LLaVA vision tower the same way), and the config's indices are made absolute, so that
`hidden_states[i]` names the same state in the shorter tower: the features are the very same
tensors, so HF generate's tokens are untouched. A tower that uses its last layer is left alone.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)


# A vision tower layer's weights in a checkpoint (sizing counts only the layers that load: workers/sizing.py).
TOWER_LAYER = re.compile(r"(?:^|\.)vision_tower\.(?:vision_model\.)?encoder\.layers\.(\d+)\.")


def _absolute(feature_layer: int | list[int], num_layers: int) -> list[int]:
    """hidden_states has num_layers + 1 entries (the embeddings, then each layer's output): index
    i < 0 is num_layers + 1 + i."""
    layers = [feature_layer] if isinstance(feature_layer, int) else feature_layer
    return [i if i >= 0 else num_layers + 1 + i for i in layers]


def layers_read(feature_layer: int | list[int] | None, num_layers: int) -> int | None:
    """How many of the tower's `num_layers` layers the image features read; None: all of them (or no
    `vision_feature_layer` to go by)."""
    if feature_layer is None or num_layers <= 0:
        return None
    absolute = _absolute(feature_layer, num_layers)
    keep = max(absolute)
    return keep if 0 <= min(absolute) and keep < num_layers else None


def drop_unread_vision_layers(model: Any) -> int:
    """Trim `model`'s CLIP-style vision tower (its encoder.layers) in place; returns the layers dropped."""
    import torch

    config = model.config
    wanted = getattr(config, "vision_feature_layer", None)
    tower = getattr(model.model, "vision_tower", None)
    # transformers' CLIPVisionModel holds its encoder directly (older versions: under .vision_model)
    encoder = getattr(tower, "encoder", None) or getattr(getattr(tower, "vision_model", None), "encoder", None)
    layers = getattr(encoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or (keep := layers_read(wanted, len(layers))) is None:
        return 0
    n = len(layers)
    encoder.layers = layers[:keep]
    absolute = _absolute(wanted, n)
    config.vision_feature_layer = absolute[0] if isinstance(wanted, int) else absolute
    log.info("vision tower: %d of its %d layers run (image features read hidden state %s)", keep, n,
             config.vision_feature_layer)
    return n - keep
