"""What the engine must do for a checkpoint, read from its config.json and its model class's source.

A family with tests here is served on those tests; any other transformers VLM is served only when
every trait it has is one the engine honours (and a load-time probe then proves the tokens,
workers/probe.py). A trait the engine cannot honour is named in the refusal, never ignored. Pure
Python and torch-free: the coordinator reads traits too, at admission.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Layer kinds transformers writes in `layer_types` that the paged attention honours: full causal
# attention, and a sliding window (transformers hands each sliding layer its window).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Kinds it does not, with the reason a user reads in the refusal.
REFUSED_LAYER_TYPES = {
    "linear_attention": "linear attention layers (Gated DeltaNet): not supported outside the tested Qwen3.5 families "
                        "(workers/linear_state.py keeps their state; other families' state layouts are unproven)",
    "chunked_attention": "chunked attention layers (attention_chunk_size): not supported outside the tested Llama 4 "
                         "family (its text model's other traits come with them there)",
    "conv": "short convolution layers (a recurrent conv state per sequence): not supported",
    "mamba": "state-space (Mamba) layers: not supported",
}


@dataclass(frozen=True)
class Traits:
    """The attention and position facts one checkpoint's language model runs with."""

    model_type: str
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mrope: bool = False  # 3-D rotary positions from the model's own get_rope_index
    token_type_mask: bool = False  # the model builds its own bidirectional mask from token_type_ids
    prefix_lm: bool = False  # ... over the whole prompt prefix (PaliGemma), not one image at a time
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    encoder_decoder: bool = False
    bidirectional_text: bool = False

    def unsupported(self, honoured: frozenset[str] = frozenset()) -> list[str]:
        """Each trait the generic engine cannot honour, in words; empty when it honours them all.
        `honoured`: the trait names (a layer kind, `token_type_mask`, `bidirectional_text`...) a tested
        family's own code and tests cover (FamilyRules.honoured_traits); any other is still refused, so a
        tested model_type over an unusual text model (a LLaVA config over a hybrid text model) is not served
        on its family's tests."""
        found: dict[str, str] = {}
        for kind in dict.fromkeys(self.layer_types):
            if kind in REFUSED_LAYER_TYPES:
                found[kind] = REFUSED_LAYER_TYPES[kind]
            elif kind not in SERVED_LAYER_TYPES:
                found[kind] = f"layer type {kind!r}: unknown to mserve, not supported"
        if self.attention_chunk_size and "chunked_attention" not in self.layer_types:
            found["attention_chunk_size"] = (f"attention_chunk_size={self.attention_chunk_size}: chunked attention "
                                             "is not supported")
        if self.prefix_lm:
            found["prefix_lm"] = "prefix-LM attention (bidirectional over the whole prompt, from token_type_ids): not supported"
        elif self.token_type_mask:
            found["token_type_mask"] = ("bidirectional attention built by the model from token_type_ids: not "
                                        "supported without a family module")
        if self.attn_logit_softcapping:
            found["attn_logit_softcapping"] = (f"attention logit softcapping ({self.attn_logit_softcapping}): not "
                                               "supported by the paged attention")
        if self.encoder_decoder:
            found["encoder_decoder"] = "an encoder-decoder language model: not supported (decoder-only serving)"
        if self.bidirectional_text:
            found["bidirectional_text"] = "bidirectional text attention (use_bidirectional_attention): not supported"
        return [why for name, why in found.items() if name not in honoured]

    def describe(self) -> dict[str, Any]:
        """The traits as plain values, for `mserve verify` and the verdict file."""
        kinds = {k: self.layer_types.count(k) for k in dict.fromkeys(self.layer_types)}
        return {"layer_types": kinds, "sliding_window": self.sliding_window,
                "attention_chunk_size": self.attention_chunk_size, "mrope": self.mrope,
                "token_type_mask": self.token_type_mask, "prefix_lm": self.prefix_lm,
                "attn_logit_softcapping": self.attn_logit_softcapping,
                "final_logit_softcapping": self.final_logit_softcapping, "encoder_decoder": self.encoder_decoder}


def text_config_of(cfg: dict) -> dict:
    """The language model's config: `text_config`, else the top level (a single-config VLM like Fuyu)."""
    return cfg.get("text_config") or cfg


def _layer_types(text: dict) -> tuple[str, ...]:
    """`layer_types` as saved; for an older config without it, what transformers derives: every
    layer sliding when a window is set and used (Mistral, Qwen2 with use_sliding_window)."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    n = int(text.get("num_hidden_layers") or 0)
    if text.get("model_type") == "llama4_text" and text.get("attention_chunk_size"):  # Llama4TextConfig's rule
        rope = text.get("no_rope_layers") or [int((i + 1) % text.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
        return tuple("chunked_attention" if r else "full_attention" for r in rope)
    sliding = text.get("sliding_window") and text.get("use_sliding_window", True)
    return ("sliding_attention" if sliding else "full_attention",) * n


def _modeling_source(model_type: str) -> str:
    """The text of transformers' modeling module for this model_type, read without importing it (no torch)."""
    try:
        spec = importlib.util.find_spec(f"transformers.models.{model_type.replace('-', '_')}.modeling_"
                                        f"{model_type.replace('-', '_')}")
    except (ImportError, ValueError):
        return ""
    return Path(spec.origin).read_text() if spec is not None and spec.origin else ""


def read_traits(cfg: dict) -> Traits:
    """The traits of the checkpoint whose config.json is `cfg`."""
    model_type = str(cfg.get("model_type"))
    text = text_config_of(cfg)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    source = _modeling_source(model_type)
    # The model's own forward takes token_type_ids to build a bidirectional mask (Gemma 3 within each
    # image, PaliGemma over the prefix: `token_type_ids == 0` marks the prefix there).
    token_type_mask = re.search(r"\btoken_type_ids\b", source) is not None
    prefix_lm = token_type_mask and re.search(r"\btoken_type_ids\s*==\s*0\b", source) is not None
    return Traits(
        model_type=model_type,
        layer_types=_layer_types(text),
        sliding_window=text.get("sliding_window"),
        attention_chunk_size=text.get("attention_chunk_size"),
        mrope="mrope_section" in rope,
        token_type_mask=token_type_mask,
        prefix_lm=prefix_lm,
        attn_logit_softcapping=text.get("attn_logit_softcapping"),
        final_logit_softcapping=text.get("final_logit_softcapping"),
        encoder_decoder=bool(cfg.get("is_encoder_decoder") or text.get("is_encoder_decoder")),
        bidirectional_text=bool(text.get("use_bidirectional_attention")),
    )
