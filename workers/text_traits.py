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


def attention_chunks(text: Any) -> list[int | None] | None:
    """Each layer's attention chunk where the model has chunked local layers (Llama 4's "chunked_attention"
    layers attend within [pos // chunk * chunk, pos], HF's create_chunked_causal_mask), None on its other
    layers; None for a model without such layers. transformers hands the attention function no chunk, so the
    engine reads it here (workers/paged_attention.py)."""
    chunk = getattr(text, "attention_chunk_size", None)
    types = list(getattr(text, "layer_types", None) or ())
    if not chunk or "chunked_attention" not in types:
        return None
    return [chunk if kind == "chunked_attention" else None for kind in types]


def temperature_scaled(query: torch.Tensor, positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature tuning of a NoPE layer's queries [1, heads, T, head_dim], each token
    at its own position in its sequence: HF's operations in HF's order (elementwise, so the same bits)."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


class TemperatureAtPositions(torch.nn.Module):
    """A Llama 4 NoPE attention layer whose temperature tuning runs at each packed token's own position.

    HF scales the queries by `arange(T) + cache length`: the positions of one sequence, where a packed step
    holds chunks of several, each starting where its sequence is. In an engine forward the layer's own
    scaling is off and the paged attention function scales by the batch's positions (temperature_scaled);
    outside one (HF generate on the same object) the layer runs as it is."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any):
        if kwargs.get("mserve_batch") is None:
            return self.inner(*args, **kwargs)
        self.inner.attn_temperature_tuning = False
        try:
            return self.inner(*args, mserve_temperature=(self.inner.floor_scale, self.inner.attn_scale), **kwargs)
        finally:
            self.inner.attn_temperature_tuning = True


def wrap_temperature_layers(language_model: torch.nn.Module) -> int:
    """Put each decoder layer's temperature-tuned NoPE attention (Llama 4) behind TemperatureAtPositions;
    returns how many."""
    n = 0
    for layer in getattr(language_model, "layers", ()):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "attn_temperature_tuning", False) and not getattr(attn, "use_rope", True):
            layer.self_attn = TemperatureAtPositions(attn)
            n += 1
    return n
