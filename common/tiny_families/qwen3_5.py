"""Qwen3.5: Qwen3-VL's vision tower without DeepStack, and a hybrid text model of Gated DeltaNet
(linear attention) layers with a full-attention (gated, partial-rotary) layer every few.

The processor is Qwen3VLProcessor around Qwen2-VL's PIL image processor, as transformers' auto maps
pair them for `qwen3_5`; the chat template is Qwen3-VL's with Qwen3.5's thinking turn on the
generation prompt, so <think> and </think> are special tokens here as in the published tokenizer.
"""

from __future__ import annotations

from mserve.common.tiny_families.base import TinyFamily
from mserve.common.tiny_families.qwen import QWEN2_VL_SPECIALS, generation_config, qwen_style_tokenizer
from mserve.common.tiny_families.qwen3_vl import QWEN3_VL_CHAT_TEMPLATE, QWEN3_VL_PATCH, save_qwen3_vl_processor

QWEN3_5_SPECIALS = QWEN2_VL_SPECIALS + ["<think>", "</think>"]

# Qwen3.5's generation prompt opens a thinking block (closed at once when enable_thinking is false).
QWEN3_5_CHAT_TEMPLATE = QWEN3_VL_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def qwen3_5_tokenizer(vocab_size: int):
    return qwen_style_tokenizer(vocab_size, QWEN3_5_SPECIALS, QWEN3_5_CHAT_TEMPLATE)


def qwen3_5_config(dims: dict, tok, std: float, cls: str = "Qwen3_5Config", **text_extra):
    import transformers

    ids = tok.convert_tokens_to_ids
    vision = dict(
        depth=dims["v_layers"], hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_heads=dims["v_heads"], out_hidden_size=dims["hidden"], patch_size=QWEN3_VL_PATCH,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=dims["v_pos"],
        initializer_range=std,
    )
    head_dim = dims["head_dim"]  # independent of hidden / heads, as in the published configs
    rotary = int(head_dim * 0.25) // 2  # partial_rotary_factor 0.25, as published: mrope_section covers half of it
    text = dict(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=len(dims["layer_types"]), layer_types=list(dims["layer_types"]),
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=head_dim,
        linear_conv_kernel_dim=4, linear_key_head_dim=dims["lin_k_dim"], linear_value_head_dim=dims["lin_v_dim"],
        linear_num_key_heads=dims["lin_k_heads"], linear_num_value_heads=dims["lin_v_heads"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=std, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_interleaved": True,
                         "mrope_section": [rotary - 2 * (rotary * 3 // 8), rotary * 3 // 8, rotary * 3 // 8],
                         "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **text_extra,
    )
    return getattr(transformers, cls)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                         vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def save_qwen3_5_processor(out, dims: dict, tok, layout: str) -> None:
    """Qwen3-VL's processor files (transformers maps qwen3_5 to Qwen3VLProcessor), with this template."""
    save_qwen3_vl_processor(out, dims, tok, layout, chat_template=QWEN3_5_CHAT_TEMPLATE)


_LINEAR, _FULL = "linear_attention", "full_attention"

QWEN3_5 = TinyFamily(
    arch="qwen3_5",
    # Three linear layers then a full one (the published full_attention_interval 4), twice over for `small`;
    # `tiny` ends on a linear layer too, so a step's last layer reads the state it just wrote.
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, v_pos=64, max_pixels=256 * 256,
                       hidden=64, inter=128, heads=4, kv_heads=2, head_dim=32, lin_k_dim=16, lin_v_dim=16, lin_k_heads=2,
                       lin_v_heads=4, layer_types=(_LINEAR, _LINEAR, _LINEAR, _FULL, _LINEAR)),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, v_pos=256, max_pixels=512 * 512,
                        hidden=512, inter=1376, heads=8, kv_heads=4, head_dim=64, lin_k_dim=64, lin_v_dim=64, lin_k_heads=4,
                        lin_v_heads=8, layer_types=(_LINEAR, _LINEAR, _LINEAR, _FULL) * 2)},
    init_std={"tiny": 0.15, "small": 0.15},
    tokenizer=qwen3_5_tokenizer, config=qwen3_5_config, save_processor=save_qwen3_5_processor,
    generation_config=generation_config,
)


def qwen3_5_moe_config(dims: dict, tok, std: float):
    # Qwen3.5-MoE: every layer's MLP is sparse (routed experts plus a gated shared expert), beside the same
    # hybrid attention. Several experts chosen per token, so a shortcut that took only the top one, dropped
    # the routing weights or the shared expert's gate changes the tokens.
    return qwen3_5_config(dims, tok, std, "Qwen3_5MoeConfig", num_experts=dims["experts"],
                          num_experts_per_tok=dims["experts_per_tok"], moe_intermediate_size=dims["moe_inter"],
                          shared_expert_intermediate_size=dims["shared_inter"])


QWEN3_5_MOE = TinyFamily(
    arch="qwen3_5_moe",
    dims={size: {**dims, **moe} for (size, dims), moe in zip(QWEN3_5.dims.items(), (
        dict(experts=8, experts_per_tok=2, moe_inter=64, shared_inter=64),
        dict(experts=16, experts_per_tok=4, moe_inter=344, shared_inter=344)))},
    init_std=QWEN3_5.init_std,
    tokenizer=qwen3_5_tokenizer, config=qwen3_5_moe_config, save_processor=save_qwen3_5_processor,
    generation_config=generation_config,
)
