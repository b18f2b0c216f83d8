"""LLaVA-1.5 and LLaVA-NeXT (any-res): CLIP tower, Llama text model, llava-hf's processor and template."""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors

from mserve.common.tiny_families.base import PATCH_SIZE, TinyFamily, save_processor_files, train_bpe

# Published llava-hf/llava-1.5-7b-hf chat_template.json, verbatim.  It does not emit <s>:
# as with the real checkpoint, the tokenizer's post-processor prepends BOS (and
# ProcessorMixin.apply_chat_template tokenizes with add_special_tokens left on).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] "
    "!= 'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

def llava_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, ["<unk>", "<s>", "</s>"], ["<image>", "<pad>"])
    # Like the Llama tokenizer of llava-hf: BOS is prepended by the tokenizer, not the template.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"},
        padding_side="left", chat_template=LLAVA_CHAT_TEMPLATE,
    )


def llava_config(dims: dict, tok, std: float):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_hidden_layers=dims["v_layers"], num_attention_heads=dims["v_heads"],
        image_size=dims["image_size"], patch_size=PATCH_SIZE, projection_dim=dims["v_hidden"],
        hidden_act="quick_gelu", initializer_range=std,
    )
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, initializer_range=std,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(dims["image_size"] // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu", vision_feature_select_strategy="default",
        vision_feature_layer=-2, tie_word_embeddings=False,
    )


def _grid_pinpoints(side: int) -> list[list[int]]:
    """LLaVA-NeXT's any-res canvases (height, width), in tiles of the vision tower's side: 1x2, 2x1, 2x2,
    1x3, 3x1 as llava-hf's v1.6 checkpoints (whose side is 336)."""
    return [[side * h, side * w] for h, w in ((1, 2), (2, 1), (2, 2), (1, 3), (3, 1))]


def llava_next_config(dims: dict, tok, std: float):
    from transformers import LlavaNextConfig

    base = llava_config(dims, tok, std)
    return LlavaNextConfig(
        vision_config=base.vision_config, text_config=base.text_config,
        image_token_index=base.image_token_index, image_grid_pinpoints=_grid_pinpoints(dims["image_size"]),
        image_seq_length=base.image_seq_length, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2, tie_word_embeddings=False,
    )


def save_llava_processor(out: Path, dims: dict, tok, layout: str) -> None:
    # The PIL backend: CLIPImageProcessor proper is the torchvision one in transformers 5.
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    side = dims["image_size"]
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    save_processor_files(out, processor, image_processor, layout)  # "preprocessor": llava-hf's layout


def save_llava_next_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    side = dims["image_size"]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        image_grid_pinpoints=_grid_pinpoints(side),
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)


# "small" llava must stay exactly as is: it is the benchmark model (~31.2M). 0.15 for small llava is
# fixed by the peer benchmark we compare against; at the tiny sizes 0.15 lets greedy decoding fall
# into one token repeated ~2/3 of the time for some seeds, 0.3 gave 12-16 distinct ids out of 16.
_SMALL = dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=336,
              hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)
_TINY_TEXT = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)

LLAVA = TinyFamily(
    arch="llava",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=112, **_TINY_TEXT),
          "small": _SMALL},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=llava_tokenizer, config=llava_config, save_processor=save_llava_processor,
    generation_config=generation_config,
)
LLAVA_NEXT = TinyFamily(
    arch="llava_next",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=56, **_TINY_TEXT),
          "small": _SMALL},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=llava_tokenizer, config=llava_next_config, save_processor=save_llava_next_processor,
    generation_config=generation_config,
)
