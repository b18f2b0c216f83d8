"""GLM-4.1V / GLM-4.6V: GLM's vision tower (interpolated 2-D position table, 2x2 merge) and GLM-4 text with M-RoPE.

GLM-4.6V (`glm46v`: zai-org/GLM-4.6V-Flash and its kind) and GLM-4.1V (`glm4v`: zai-org/GLM-4.1V-9B-Thinking)
share the model code (Glm46VModel is Glm4vModel with AutoModel parts), the image processor (Qwen-like
patches of 14 px, merged 2x2, but GLM's own smart_resize that sizes an image as two frames) and the
processor's image expansion; they differ in config class, processor class and video tokens. GLM-4.5V
(`glm4v_moe`) is GLM-4.1V's tower and processor with GLM-4.5-Air's mixture-of-experts text model: a dense
first layer, then sigmoid-scored routed experts (top-k of them, renormalised) beside a shared expert. The text
model rotates half of each head (partial_rotary_factor 0.5) with M-RoPE sections in the published
8:12:12 share. Its video processor needs torchvision: its settings are written by hand, as for Qwen.
"""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import TinyFamily
from mserve.common.tiny_families.qwen import _qwen2_vl_processor, qwen_style_tokenizer, save_with_video_configs

GLM_PATCH = 14
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
            "<|end_of_video|>", "<|image|>", "<|video|>", "<think>", "</think>"]

# The vision and text branches of the published GLM-4.1V / GLM-4.6V template: "[gMASK]<sop>" first (it is
# GLM's BOS), turns as <|role|>\n, images as <|begin_of_image|><|image|><|end_of_image|>, videos as
# <|begin_of_video|><|video|><|end_of_video|>. Its tool-calling and thinking branches are left out.
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for msg in messages %}"
    "{% if msg['role'] == 'system' %}<|system|>\n{{ msg['content'] }}"
    "{% elif msg['role'] == 'user' %}<|user|>\n{% if msg['content'] is string %}{{ msg['content'] }}"
    "{% else %}{% for item in msg['content'] %}"
    "{% if item['type'] == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% elif msg['role'] == 'assistant' %}<|assistant|>\n{% if msg['content'] is string %}{{ msg['content'] }}"
    "{% else %}{% for item in msg['content'] %}{{ item['text'] }}{% endfor %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def glm4v_tokenizer(vocab_size: int):
    return qwen_style_tokenizer(vocab_size, SPECIALS, GLM4V_CHAT_TEMPLATE, eos="<|endoftext|>", image="<|image|>",
                                video="<|video|>")


def _glm_config(dims: dict, tok, std: float, config_class: str, text_type: str, **text_extra):
    import transformers

    ids = tok.convert_tokens_to_ids
    vision = dict(
        model_type="glm4v_vision", depth=dims["v_layers"], hidden_size=dims["v_hidden"],
        intermediate_size=dims["v_inter"], num_heads=dims["v_heads"], out_hidden_size=dims["hidden"],
        patch_size=GLM_PATCH, image_size=GLM_PATCH * dims["v_grid"], spatial_merge_size=2, temporal_patch_size=2,
        in_channels=3, initializer_range=std,
    )
    head_dim = dims["hidden"] // dims["heads"]
    half = head_dim // 4  # rotary on half the head: its head_dim / 4 frequencies split 8:12:12 as published
    t_dim = half // 4
    text = dict(
        model_type=text_type, vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=32768, rms_norm_eps=1e-5, initializer_range=std, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [t_dim, (half - t_dim) // 2, half - t_dim - (half - t_dim) // 2]},
        **text_extra,
    )
    return getattr(transformers, config_class)(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))


def glm46v_config(dims: dict, tok, std: float):
    return _glm_config(dims, tok, std, "Glm46VConfig", "glm4v_text")


def glm4v_config(dims: dict, tok, std: float):
    return _glm_config(dims, tok, std, "Glm4vConfig", "glm4v_text")


def glm4v_moe_config(dims: dict, tok, std: float):
    # Several routed experts, two chosen per token, plus the shared one; the first layer dense, as published
    # (GLM-4.5V: 128 routed, 8 per token, 1 shared, first_k_dense_replace 1).
    return _glm_config(dims, tok, std, "Glm4vMoeConfig", "glm4v_moe_text", moe_intermediate_size=dims["moe_inter"],
                       n_routed_experts=dims["experts"], num_experts_per_tok=dims["experts_per_tok"],
                       n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                       routed_scaling_factor=1.0, attention_bias=True)


def _save_processor(out: Path, dims: dict, tok, layout: str, processor_class: str) -> None:
    """processor_config.json (image and video processors nested), tokenizer and template through the
    processor's save_pretrained; the hub's preprocessor_config.json / video_preprocessor_config.json too
    unless layout is "processor"."""
    import transformers

    image_class = processor_class.replace("Processor", "ImageProcessorPil")  # GLM-4.5V's is GLM-4.1V's
    # The published settings at a tiny pixel budget: GLM's smart_resize counts an image as two frames.
    image_processor = getattr(transformers, image_class)(
        size={"shortest_edge": 112 * 112, "longest_edge": dims["max_pixels"]}, patch_size=GLM_PATCH, merge_size=2,
        temporal_patch_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    image_config = {**image_processor.to_dict(), "image_processor_type": image_class.removesuffix("Pil"),
                    "processor_class": processor_class}
    video_config = {  # the video processor's published settings, at the tiny size
        "video_processor_type": processor_class.replace("Processor", "VideoProcessor"),
        "processor_class": processor_class, "size": {"shortest_edge": 112 * 112, "longest_edge": dims["max_pixels"]},
        "patch_size": GLM_PATCH, "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "do_sample_frames": True,
        "image_mean": image_config["image_mean"], "image_std": image_config["image_std"], "do_resize": True,
        "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3, "rescale_factor": 1 / 255,
    }
    save_with_video_configs(out, _qwen2_vl_processor(image_processor, tok, video_config, processor_class,
                                                     GLM4V_CHAT_TEMPLATE), image_config, video_config, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    # GLM stops on <|endoftext|>, <|user|> and <|observation|>, as the published generation_config.json.
    ids = tok.convert_tokens_to_ids
    return GenerationConfig(eos_token_id=[ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")],
                            pad_token_id=ids("<|endoftext|>"))


_DIMS = {"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, v_grid=8, max_pixels=2 * 224 * 224,
                      hidden=64, inter=128, layers=3, heads=2, kv_heads=1),
         "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, v_grid=16, max_pixels=2 * 448 * 448,
                       hidden=512, inter=1376, layers=8, heads=4, kv_heads=2)}

GLM46V = TinyFamily(
    arch="glm46v", dims=_DIMS, init_std={"tiny": 0.15, "small": 0.15},
    tokenizer=glm4v_tokenizer, config=glm46v_config,
    save_processor=lambda out, dims, tok, layout: _save_processor(out, dims, tok, layout, "Glm46VProcessor"),
    generation_config=generation_config,
)
GLM4V = TinyFamily(
    arch="glm4v", dims=_DIMS, init_std={"tiny": 0.15, "small": 0.15},
    tokenizer=glm4v_tokenizer, config=glm4v_config,
    save_processor=lambda out, dims, tok, layout: _save_processor(out, dims, tok, layout, "Glm4vProcessor"),
    generation_config=generation_config,
)
GLM4V_MOE = TinyFamily(
    arch="glm4v_moe", dims={size: {**dims, **moe} for (size, dims), moe in zip(_DIMS.items(), (
        dict(experts=8, experts_per_tok=2, moe_inter=64), dict(experts=16, experts_per_tok=4, moe_inter=344)))},
    init_std={"tiny": 0.15, "small": 0.15},
    tokenizer=glm4v_tokenizer, config=glm4v_moe_config,
    save_processor=lambda out, dims, tok, layout: _save_processor(out, dims, tok, layout, "Glm4vProcessor"),
    generation_config=generation_config,
)
