"""What a text model takes or does beyond embeddings, positions and attention, read from the model itself.

Gemma 4 brought three: layers whose K/V differ in shape (its global layers), per-layer embeddings looked
up by token id (PLE), and softcapped logits. The runner (workers/model_runner.py) asks these once per
step; a model without the trait gets None, {} or its logits untouched.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def layer_kv_shapes(text: Any) -> list[tuple[int, int]] | None:
    """Each layer's (kv_heads, head_dim) for a text config whose layers differ (transformers' per_layer_config:
    Gemma 4's global layers have their own head size and KV heads); None when every layer is the same."""
    per_layer = getattr(text, "per_layer_config", None)
    if not per_layer:
        return None
    return [(per_layer[i].num_key_value_heads, per_layer[i].head_dim) for i in range(text.num_hidden_layers)]


def per_layer_inputs(language_model: Any, ids: torch.Tensor, placeholder_ids: Sequence[int]) -> dict:
    """The per-layer embeddings' token part (Gemma 4's PLE), as Gemma4Model.forward makes it: looked up by
    token id, image placeholders read as the pad token (their rows also take the image features' projection,
    inside the text model). {} for a text model without per-layer inputs."""
    if not getattr(language_model, "hidden_size_per_layer_input", 0):
        return {}
    pad = language_model.config.pad_token_id
    ids = torch.where(torch.isin(ids, torch.tensor(list(placeholder_ids), device=ids.device)), pad, ids)
    return {"per_layer_inputs": language_model.get_per_layer_inputs(ids[None])}


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """HF's final logit softcapping (Gemma 4), the same three operations in the same order."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
