"""What a text model takes or does beyond embeddings, positions and attention, read from the model itself.

Gemma 4 brought four: layers whose K/V differ in shape (its global layers), layers that reuse an earlier
layer's K/V (KV sharing), per-layer embeddings looked up by token id (PLE), and softcapped logits. The runner (workers/model_runner.py) asks these once per
step; a model without the trait gets None, {} or its logits untouched.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def layer_kv_shapes(text: Any) -> list[tuple[int, int]]:
    """Each layer's (kv_heads, head_dim). Read per layer where transformers' per_layer_config gives the layers
    their own (Gemma 4's global layers have their own head size and KV heads, and its config then refuses to
    answer head_dim for the whole model); a config without them answers for every layer."""
    per_layer = getattr(text, "per_layer_config", None)
    layers = [per_layer[i] for i in range(text.num_hidden_layers)] if per_layer else [text] * text.num_hidden_layers
    return [(c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
            for c in layers]


def kv_source_layers(text: Any) -> list[int] | None:
    """The layer whose K/V each layer attends over, where some reuse an earlier one's (Gemma 4: a layer whose
    kv_sharing_mode is "reuse" reads what the last layer of its type that "store"s computed, HF's
    shared_kv_states); None when every layer computes its own."""
    modes = getattr(text, "kv_sharing_modes", None) if getattr(text, "num_kv_shared_layers", 0) else None
    if not modes or "reuse" not in modes:
        return None
    types = text.layer_types
    stores = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return [stores[types[i]] if mode == "reuse" else i for i, mode in enumerate(modes)]


def per_layer_inputs(language_model: Any, ids: torch.Tensor, placeholder_ids: Sequence[int]) -> dict:
    """The per-layer embeddings' token part (Gemma 4's PLE), as Gemma4Model.forward makes it: looked up by
    token id, image placeholders read as the pad token (their rows also take the image features' projection,
    inside the text model). {} for a text model without per-layer inputs."""
    if not getattr(language_model, "hidden_size_per_layer_input", 0):
        return {}
    return {"per_layer_inputs": language_model.get_per_layer_inputs(placeholders_as_pad(language_model, ids,
                                                                                        placeholder_ids)[None])}


def placeholders_as_pad(language_model: Any, ids: torch.Tensor, placeholder_ids: Sequence[int]) -> torch.Tensor:
    """`ids` with every placeholder token read as the pad token, as Gemma4Model.forward reads them before its
    embedding lookups: a prompt's placeholder rows then take the item's features, but a placeholder token the
    model generated stays the pad token's embedding."""
    pad = language_model.config.pad_token_id
    return torch.where(torch.isin(ids, torch.tensor(list(placeholder_ids), device=ids.device)), pad, ids)


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """HF's final logit softcapping (Gemma 4), the same three operations in the same order."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
