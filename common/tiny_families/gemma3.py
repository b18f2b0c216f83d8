"""Gemma 3: SigLIP tower, avg-pool + RMSNorm projector, Gemma3 text model with sliding-window layers.

The tiny text model alternates one sliding-window layer (window 12) with one global layer, so any
prompt of a test is longer than the window; each image is 16 soft tokens (a 112-pixel image, 8x8
patches pooled 2x2), longer than the window too, so the bidirectional image attention and the
window meet. Local and global layers get different rope thetas, as the published checkpoints do.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors

from mserve.common.tiny_families.base import PATCH_SIZE, TinyFamily, save_processor_files, train_bpe

SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]

# Written for mserve after the published Gemma 3 template's shape (not a copy): BOS first; a system
# message is folded into the first user turn; assistant turns are "model" turns; each image part is
# rendered as <start_of_image>, which the processor expands to boi + soft tokens + eoi.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- for part in messages[0]['content'] if messages[0]['content'] is not string -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.prefix = ns.prefix + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if messages[0]['content'] is string -%}{%- set ns.prefix = messages[0]['content'] -%}{%- endif -%}"
    "{%- set ns.prefix = ns.prefix + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if loop.first -%}{{ ns.prefix }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma_tokenizer(vocab_size: int, specials: list[str], extra_special_tokens: dict[str, str], chat_template: str):
    """A Gemma-style tokenizer (Gemma 3 and Gemma 4 alike): <pad> <eos> <bos> <unk> first, then the
    family's `specials`; like Gemma's tokenizer, BOS is added by the tokenizer (the template emits it too)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, ["<pad>", "<eos>", "<bos>", "<unk>"], specials)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens=extra_special_tokens, padding_side="left", chat_template=chat_template,
    )


def gemma3_tokenizer(vocab_size: int):
    return gemma_tokenizer(vocab_size, SPECIALS, {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                                  "eoi_token": "<end_of_image>"}, GEMMA3_CHAT_TEMPLATE)


def gemma3_config(dims: dict, tok, std: float):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
        num_attention_heads=dims["v_heads"], image_size=dims["image_size"], patch_size=PATCH_SIZE,
        vision_use_head=False,
    )
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        head_dim=dims["hidden"] // dims["heads"], query_pre_attn_scalar=dims["hidden"] // dims["heads"],
        sliding_window=dims["sliding_window"], layer_types=dims["layer_types"], max_position_embeddings=4096,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=std,
    )
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=dims["mm_tokens"],
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"), initializer_range=std,
    )


def save_gemma3_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    side = dims["image_size"]
    image_processor = Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=False,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=dims["mm_tokens"],
                                chat_template=GEMMA3_CHAT_TEMPLATE)
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                            pad_token_id=tok.pad_token_id)


_TINY = dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=112, mm_tokens=16,
             hidden=64, inter=128, layers=2, heads=4, kv_heads=2, sliding_window=12,
             layer_types=["sliding_attention", "full_attention"])
_SMALL = dict(v_hidden=128, v_inter=512, v_layers=4, v_heads=4, image_size=224, mm_tokens=64,
              hidden=256, inter=768, layers=6, heads=4, kv_heads=2, sliding_window=64,
              layer_types=["sliding_attention"] * 5 + ["full_attention"])

GEMMA3 = TinyFamily(
    arch="gemma3",
    dims={"tiny": _TINY, "small": _SMALL},
    # Gemma scales embeddings by sqrt(hidden) and its norms by (1 + weight): at 0.3 (llava's tiny std) greedy
    # decoding repeats one token; 0.05 gave 11-16 distinct ids out of 16, outputs that depend on the image
    # and on the bidirectional image attention (checked against HF generate without token_type_ids).
    init_std={"tiny": 0.05, "small": 0.03},
    tokenizer=gemma3_tokenizer, config=gemma3_config, save_processor=save_gemma3_processor,
    generation_config=generation_config,
)
