"""Mistral 3 (Mistral-Small-3.1 layout): Pixtral vision tower (2-D RoPE, any image size up to its
longest edge), patch-merger projector, Mistral text model, PixtralProcessor and a Mistral chat template."""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors

from mserve.common.tiny_families.base import PATCH_SIZE, TinyFamily, save_processor_files, train_bpe

# Written for mserve after the published mistralai/Mistral-Small-3.1-24B-Instruct-2503 template: BOS,
# an optional [SYSTEM_PROMPT]...[/SYSTEM_PROMPT], each user turn in [INST]...[/INST] with one [IMG]
# per image in content order, each assistant turn followed by EOS. The published one also inserts a
# default system prompt carrying today's date; this one has none, so a prompt does not change by day.
MISTRAL3_CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for block in content if block['type'] == 'text' -%}{{ block['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' + text_of(messages[0]['content']) + '[/SYSTEM_PROMPT]' -}}"
    "{%- set turns = messages[1:] -%}{%- else -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}{{- '[INST]' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for block in message['content'] -%}"
    "{%- if block['type'] == 'text' -%}{{- block['text'] -}}"
    "{%- elif block['type'] in ['image', 'image_url'] -%}{{- '[IMG]' -}}"
    "{%- else -%}{{- raise_exception('Only text and image blocks are supported in message content!') -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- text_of(message['content']) + eos_token -}}"
    "{%- else -%}{{- raise_exception('Only user, system and assistant roles are supported!') -}}"
    "{%- endif -%}{%- endfor -%}"
)

# The published tokenizer's control tokens, at the front of the vocabulary as there.
MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]",
                     "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]


def mistral3_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, MISTRAL3_SPECIALS, [])
    bos = tok.token_to_id("<s>")
    # Like the published tokenizer, it prepends BOS itself; the template also writes it, and a chat
    # prompt is tokenized without special tokens (transformers' apply_chat_template does the same).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "[IMG]"}, chat_template=MISTRAL3_CHAT_TEMPLATE,
    )


def mistral3_config(dims: dict, tok, std: float):
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
        num_attention_heads=dims["v_heads"], head_dim=dims["v_hidden"] // dims["v_heads"],
        image_size=dims["longest_edge"], patch_size=PATCH_SIZE, hidden_act="silu", initializer_range=std,
    )
    text = MistralConfig(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        head_dim=dims["hidden"] // dims["heads"], max_position_embeddings=8192, rms_norm_eps=1e-5,
        sliding_window=None, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, initializer_range=std,
    )
    return Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        projector_hidden_act="gelu", vision_feature_layer=-1, multimodal_projector_bias=False,
        spatial_merge_size=2, tie_word_embeddings=False,
    )


def save_mistral3_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import PixtralImageProcessorPil

    from mserve.common.families.pixtral import processor_class

    PixtralProcessor = processor_class()  # transformers' top level hands it out only with torchvision

    # As published: the image processor's patch_size is the tower's (14); the processor resizes to
    # multiples of patch_size * spatial_merge_size itself.
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": dims["longest_edge"]}, patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE},
    )
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
                                 spatial_merge_size=2, chat_template=MISTRAL3_CHAT_TEMPLATE)
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)


_TINY_TEXT = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)

MISTRAL3 = TinyFamily(
    arch="mistral3",
    # longest_edge 168 = 6 merged 28-px patches: an image is at most 6 rows of 6 [IMG] tokens.
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, longest_edge=168, **_TINY_TEXT),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, longest_edge=448,
                        hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=mistral3_tokenizer, config=mistral3_config, save_processor=save_mistral3_processor,
    generation_config=generation_config,
)
