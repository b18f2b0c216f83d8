"""InternVL 3 / 3.5 (HF layout): InternViT tower, pixel-shuffle projector, Qwen2 text model, tiles of
GotOcr2's dynamic tiling plus a thumbnail, and the InternVLProcessor with the converted checkpoints' template."""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import (PATCH_SIZE, TinyFamily, save_processor_files, train_bpe,
                                              with_video_stand_in)

# The chat template of OpenGVLab/InternVL3-*-hf (transformers' conversion script): no default system
# prompt, one <IMG_CONTEXT> line per image that the processor expands to <img> + context tokens + </img>.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


def internvl_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, [], SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def image_seq_length(dims: dict) -> int:
    """Context tokens per tile: the tower's patches after the 0.5 pixel shuffle."""
    return (dims["image_size"] // PATCH_SIZE) ** 2 // 4


def internvl_config(dims: dict, tok, std: float):
    from transformers import InternVLConfig

    vision = dict(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
        num_attention_heads=dims["v_heads"], image_size=dims["image_size"], patch_size=PATCH_SIZE,
        initializer_range=std, use_mean_pooling=False, layer_scale_init_value=1.0,
    )
    text = dict(
        model_type="qwen2", vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, initializer_range=std,
    )
    return InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=image_seq_length(dims), downsample_ratio=0.5, projector_hidden_act="gelu",
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )


def save_internvl_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

    side = dims["image_size"]
    image_processor = GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True,
                                              min_patches=1, max_patches=dims["max_patches"])
    processor = with_video_stand_in(InternVLProcessor, {"video_processor_type": "InternVLVideoProcessor"},
                                    image_processor=image_processor, tokenizer=tok,
                                    image_seq_length=image_seq_length(dims), chat_template=INTERNVL_CHAT_TEMPLATE)
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[tok.eos_token_id, endoftext], pad_token_id=endoftext)


_TINY_TEXT = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)
_SMALL_TEXT = dict(hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)

# Tiny tiles are 56 px (4 context tokens each) and at most 6 per image, so a 100x60 image already
# becomes several tiles plus the thumbnail.
INTERNVL = TinyFamily(
    arch="internvl",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=56, max_patches=6, **_TINY_TEXT),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=224, max_patches=6,
                        **_SMALL_TEXT)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=internvl_tokenizer, config=internvl_config, save_processor=save_internvl_processor,
    generation_config=generation_config,
)
