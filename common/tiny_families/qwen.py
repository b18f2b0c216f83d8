"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution towers with M-RoPE, Qwen's processor and template."""

from __future__ import annotations

import json
from pathlib import Path

from mserve.common.tiny_families.base import PATCH_SIZE, TinyFamily, train_bpe, with_video_stand_in

# Published Qwen/Qwen2-VL-*-Instruct chat template, verbatim (no BOS, default system prompt).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value "
    "= image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

def qwen_style_tokenizer(vocab_size: int, specials: list[str], chat_template: str, eos: str = "<|im_end|>",
                         image: str = "<|image_pad|>", video: str = "<|video_pad|>"):
    """The tokenizer of the Qwen-VL line (and GLM-4V, which differs in its tokens only): no trained
    specials, <|endoftext|> pads, image and video placeholders named as the processor expects."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, [], specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": image, "video_token": video},
        padding_side="left", chat_template=chat_template,
    )


def qwen_tokenizer(vocab_size: int):
    return qwen_style_tokenizer(vocab_size, QWEN2_VL_SPECIALS, QWEN2_VL_CHAT_TEMPLATE)


def qwen2_vl_config(dims: dict, tok, std: float):
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=dims["v_layers"], embed_dim=dims["v_hidden"], hidden_size=dims["hidden"],
        num_heads=dims["v_heads"], mlp_ratio=dims["v_mlp_ratio"], patch_size=PATCH_SIZE,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu",
        initializer_range=std,
    )
    return Qwen2VLConfig(text_config=_qwen_text(dims, tok, std), vision_config=vision, tie_word_embeddings=False,
                         **_qwen_token_ids(tok))


def qwen2_5_vl_config(dims: dict, tok, std: float):
    from transformers import Qwen2_5_VLConfig

    # Qwen2.5-VL's tower: SwiGLU MLP, window attention (112 px windows = 4x4 merged patches here) with
    # the last block attending over the whole image, as the real checkpoints' fullatt_block_indexes do.
    vision = dict(
        depth=dims["v_layers"], hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_heads=dims["v_heads"], out_hidden_size=dims["hidden"], patch_size=PATCH_SIZE,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="silu", window_size=112,
        fullatt_block_indexes=[dims["v_layers"] - 1], tokens_per_second=2, initializer_range=std,
    )
    return Qwen2_5_VLConfig(text_config=_qwen_text(dims, tok, std), vision_config=vision,
                            tie_word_embeddings=False, **_qwen_token_ids(tok))


def _qwen_token_ids(tok) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _qwen_text(dims: dict, tok, std: float) -> dict:
    head_dim = dims["hidden"] // dims["heads"]
    # M-RoPE splits the head_dim/2 rotary frequencies over (temporal, height, width);
    # keep Qwen's 2:3:3 proportion (the real 128-dim heads use [16, 24, 24]).
    half = head_dim // 2
    t_dim = half // 4
    h_dim = (half - t_dim) // 2
    mrope_section = [t_dim, h_dim, half - t_dim - h_dim]
    return dict(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        max_window_layers=dims["layers"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, initializer_range=std,
    )


def _qwen2_vl_processor(image_processor, tok, video_config: dict, processor_class: str = "Qwen2VLProcessor",
                        chat_template: str = QWEN2_VL_CHAT_TEMPLATE):
    """A real Qwen2VLProcessor (or Qwen2_5_VLProcessor) whose video processor is a stand-in (base.py)."""
    import transformers

    return with_video_stand_in(getattr(transformers, processor_class), video_config, image_processor=image_processor,
                               tokenizer=tok, chat_template=chat_template)


def save_qwen2_vl_processor(out: Path, dims: dict, tok, layout: str, processor_class: str = "Qwen2VLProcessor") -> None:
    """Write the processor files of a Qwen2-VL (or Qwen2.5-VL: the same image and video processors) folder.

    processor_config.json (image and video processors nested), the tokenizer and the chat template
    come from ``Qwen2VLProcessor.save_pretrained``; the video processor's settings are written by
    hand (its class needs torchvision). The legacy preprocessor_config.json /
    video_preprocessor_config.json are those of the hub checkpoints.
    """
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=dims["max_pixels"], patch_size=PATCH_SIZE,
        merge_size=2, temporal_patch_size=2,
    )
    image_config = {**image_processor.to_dict(), "processor_class": processor_class}
    video_config = {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": processor_class,
        "size": {"shortest_edge": 56 * 56, "longest_edge": dims["max_pixels"]},
        "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": image_config["image_mean"], "image_std": image_config["image_std"],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "resample": 3, "rescale_factor": 1 / 255,
    }
    save_with_video_configs(out, _qwen2_vl_processor(image_processor, tok, video_config, processor_class),
                            image_config, video_config, layout)


def save_with_video_configs(out: Path, processor, image_config: dict, video_config: dict, layout: str) -> None:
    """A processor with a stand-in video processor, in one of common/tiny_model.py's LAYOUTS: its
    processor_config.json, tokenizer and chat template; unless `layout` is "processor", the image and
    video processors' own configs, written by hand (the video processor's class needs torchvision);
    for "preprocessor", no processor_config.json, as Qwen/Qwen2-VL-*-Instruct on the hub."""
    processor.save_pretrained(out)
    if layout != "processor":
        for name, config in [("preprocessor_config.json", image_config),
                             ("video_preprocessor_config.json", video_config)]:
            (out / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if layout == "preprocessor":
        (out / "processor_config.json").unlink()


def generation_config(tok):
    from transformers import GenerationConfig

    # Qwen2-VL stops on <|im_end|> as well as <|endoftext|>, and has no real BOS.
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[tok.eos_token_id, endoftext],
                            pad_token_id=endoftext)


_TINY_TEXT = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)
_SMALL_TEXT = dict(hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)

QWEN2_VL = TinyFamily(
    arch="qwen2_vl",
    dims={"tiny": dict(v_hidden=32, v_layers=2, v_heads=2, v_mlp_ratio=2, max_pixels=224 * 224, **_TINY_TEXT),
          "small": dict(v_hidden=256, v_layers=4, v_heads=4, v_mlp_ratio=4, max_pixels=448 * 448, **_SMALL_TEXT)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=qwen_tokenizer, config=qwen2_vl_config, save_processor=save_qwen2_vl_processor,
    generation_config=generation_config,
)
QWEN2_5_VL = TinyFamily(
    arch="qwen2_5_vl",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, max_pixels=224 * 224, **_TINY_TEXT),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, max_pixels=448 * 448, **_SMALL_TEXT)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=qwen_tokenizer, config=qwen2_5_vl_config,
    save_processor=lambda out, dims, tok, layout: save_qwen2_vl_processor(out, dims, tok, layout, "Qwen2_5_VLProcessor"),
    generation_config=generation_config,
)
