"""Qwen3-VL: a SigLIP-style tower with DeepStack features, Qwen3 text (q/k norm) with interleaved M-RoPE.

Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B) is the same tower, processor and template with a
mixture-of-experts text model: every decoder layer's MLP is a router over experts (no shared expert).

The processor is Qwen3VLProcessor around Qwen2-VL's image processor (16 px patches, mean/std 0.5), as
the published Qwen/Qwen3-VL-*-Instruct checkpoints pair them; the video processor's settings are written
by hand (Qwen3VLVideoProcessor needs torchvision), as for Qwen2-VL (qwen.py).
"""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import TinyFamily
from mserve.common.tiny_families.qwen import (QWEN2_VL_SPECIALS, _qwen2_vl_processor, generation_config,
                                              qwen_style_tokenizer, save_with_video_configs)

QWEN3_VL_PATCH = 16

# The vision and text branches of the published Qwen3-VL-Instruct template (no default system prompt;
# images and videos as <|vision_start|><|image_pad|> / <|video_pad|><|vision_end|>). Its tool-calling and
# reasoning branches are left out: the tiny tokenizer has none of those tokens.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_vl_tokenizer(vocab_size: int):
    return qwen_style_tokenizer(vocab_size, QWEN2_VL_SPECIALS, QWEN3_VL_CHAT_TEMPLATE)


def qwen3_vl_config(dims: dict, tok, std: float, config_class: str = "Qwen3VLConfig", **text_extra):
    import transformers

    ids = tok.convert_tokens_to_ids
    # DeepStack: the merged features of these tower blocks are added to the image tokens' hidden states
    # after the first len(...) decoder layers (fewer than the text layers, as in the real checkpoints).
    vision = dict(
        depth=dims["v_layers"], hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_heads=dims["v_heads"], out_hidden_size=dims["hidden"], patch_size=QWEN3_VL_PATCH,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=dims["v_pos"],
        deepstack_visual_indexes=list(range(dims["v_layers"])), initializer_range=std,
    )
    head_dim = dims["hidden"] // dims["heads"]
    half = head_dim // 2  # the real 128-dim heads use [24, 20, 20] of 64: keep about that share
    t_dim = half - 2 * (half * 5 // 16)
    text = dict(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        head_dim=head_dim, max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=std,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                         "mrope_section": [t_dim, half * 5 // 16, half * 5 // 16]},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **text_extra,
    )
    return getattr(transformers, config_class)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                         vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def save_qwen3_vl_processor(out: Path, dims: dict, tok, layout: str, chat_template: str = QWEN3_VL_CHAT_TEMPLATE) -> None:
    """processor_config.json (image and video processors nested), tokenizer and chat template through
    Qwen3VLProcessor.save_pretrained; the hub's preprocessor_config.json / video_preprocessor_config.json
    too unless layout is "processor"."""
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 64 * 64, "longest_edge": dims["max_pixels"]}, patch_size=QWEN3_VL_PATCH,
        merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    image_config = {**image_processor.to_dict(), "processor_class": "Qwen3VLProcessor"}
    video_config = {  # Qwen3VLVideoProcessor's published settings, at the tiny size
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": 64 * 64, "longest_edge": dims["max_pixels"] * 2},
        "patch_size": QWEN3_VL_PATCH, "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4,
        "max_frames": 768, "do_sample_frames": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "resample": 3, "rescale_factor": 1 / 255,
    }
    save_with_video_configs(out, _qwen2_vl_processor(image_processor, tok, video_config, "Qwen3VLProcessor",
                                                     chat_template), image_config, video_config, layout)


QWEN3_VL = TinyFamily(
    arch="qwen3_vl",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, v_pos=64, max_pixels=256 * 256,
                       hidden=64, inter=128, layers=3, heads=4, kv_heads=2),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, v_pos=256, max_pixels=512 * 512,
                        hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)},
    # 0.3 (the other tiny families' scale) makes this tower + q/k-normed text model repeat one token.
    init_std={"tiny": 0.15, "small": 0.15},
    tokenizer=qwen3_vl_tokenizer, config=qwen3_vl_config, save_processor=save_qwen3_vl_processor,
    generation_config=generation_config,
)


def qwen3_vl_moe_config(dims: dict, tok, std: float):
    # Several experts, several chosen per token (the 30B-A3B picks 8 of 128), each layer sparse as there:
    # a shortcut that took only the top expert, or dropped the routing weights, changes the tokens.
    return qwen3_vl_config(dims, tok, std, "Qwen3VLMoeConfig", num_experts=dims["experts"],
                           num_experts_per_tok=dims["experts_per_tok"], moe_intermediate_size=dims["moe_inter"],
                           decoder_sparse_step=1, mlp_only_layers=[])


QWEN3_VL_MOE = TinyFamily(
    arch="qwen3_vl_moe",
    dims={size: {**dims, **moe} for (size, dims), moe in zip(QWEN3_VL.dims.items(), (
        dict(experts=8, experts_per_tok=2, moe_inter=64), dict(experts=16, experts_per_tok=4, moe_inter=344)))},
    init_std=QWEN3_VL.init_std,
    tokenizer=qwen3_vl_tokenizer, config=qwen3_vl_moe_config, save_processor=save_qwen3_vl_processor,
    generation_config=generation_config,
)
