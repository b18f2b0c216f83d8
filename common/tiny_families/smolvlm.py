"""SmolVLM and Idefics3: SigLIP-style tower, pixel-shuffle connector, Llama text model, images split into
tiles plus a global view, each tile's context tokens behind a <row_r_col_c> marker. Idefics3 is the same
layout with its own classes, a Llama-3 BOS and no video processor."""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import (PATCH_SIZE, TinyFamily, save_processor_files, train_bpe,
                                              with_video_stand_in)

# The chat template transformers' SmolVLMProcessor ships (processing_smolvlm.DEFAULT_CHAT_TEMPLATE), as
# HuggingFaceTB/SmolVLM2 checkpoints publish it: BOS <|im_start|> written by the template itself.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# HuggingFaceM4/Idefics3-8B-Llama3's template: the same turns, <|begin_of_text|> as BOS, no video.
IDEFICS3_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'].capitalize()}}{% if message['content'][0]['type'] "
    "== 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' "
    "%}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
MAX_GRID = 6  # <row_r_col_c> markers as in the published tokenizers (rows and columns up to 6)
SPECIALS = (["<|endoftext|>", "<|im_start|>", "<|begin_of_text|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>",
             "<image>", "<global-img>", "<video>"]
            + [f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)])


def smolvlm_tokenizer(vocab_size: int, bos: str = "<|im_start|>", template: str = SMOLVLM_CHAT_TEMPLATE):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, [], SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<end_of_utterance>", pad_token="<|im_end|>",
        padding_side="left", chat_template=template,
        extra_special_tokens={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
                              "video_token": "<video>"},
    )


def image_seq_len(dims: dict) -> int:
    """Context tokens per tile: the tower's patches after the connector's 2x2 pixel shuffle."""
    return (dims["image_size"] // PATCH_SIZE) ** 2 // 4


def smolvlm_config(dims: dict, tok, std: float, config_class: str = "SmolVLMConfig"):
    import transformers

    vision = dict(hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
                  num_attention_heads=dims["v_heads"], image_size=dims["image_size"], patch_size=PATCH_SIZE,
                  initializer_range=std)
    text = dict(
        model_type="llama", vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        initializer_range=std,
    )
    return getattr(transformers, config_class)(
        vision_config=vision, text_config=text, scale_factor=2, tie_word_embeddings=False,
        image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)


def save_smolvlm_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import SmolVLMImageProcessorPil, SmolVLMProcessor

    image_processor = _tiling_image_processor(SmolVLMImageProcessorPil, dims)
    processor = with_video_stand_in(SmolVLMProcessor, {"video_processor_type": "SmolVLMVideoProcessor"},
                                    image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len(dims),
                                    chat_template=SMOLVLM_CHAT_TEMPLATE)
    save_processor_files(out, processor, image_processor, layout)


def save_idefics3_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = _tiling_image_processor(Idefics3ImageProcessorPil, dims)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len(dims),
                                  chat_template=IDEFICS3_CHAT_TEMPLATE)
    save_processor_files(out, processor, image_processor, layout)


def _tiling_image_processor(cls, dims: dict):
    """Rescale to the longest edge, then cut into tiles of the tower's side (plus the global view)."""
    return cls(size={"longest_edge": dims["longest_edge"]}, max_image_size={"longest_edge": dims["image_size"]},
               do_image_splitting=True)


def generation_config(tok):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)


_TINY_TEXT = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)
_SMALL_TEXT = dict(hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)

# Tiny tiles are 56 px (4 context tokens each); images are rescaled to a 168 px longest edge, so any
# image becomes up to 3x3 tiles plus the global view, the grid following its aspect ratio.
SMOLVLM = TinyFamily(
    arch="smolvlm",
    dims={"tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=56, longest_edge=168,
                       **_TINY_TEXT),
          "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=224, longest_edge=672,
                        **_SMALL_TEXT)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=smolvlm_tokenizer, config=smolvlm_config, save_processor=save_smolvlm_processor,
    generation_config=generation_config,
)
IDEFICS3 = TinyFamily(
    arch="idefics3", dims=SMOLVLM.dims, init_std=SMOLVLM.init_std,
    tokenizer=lambda vocab_size: smolvlm_tokenizer(vocab_size, "<|begin_of_text|>", IDEFICS3_CHAT_TEMPLATE),
    config=lambda dims, tok, std: smolvlm_config(dims, tok, std, "Idefics3Config"),
    save_processor=save_idefics3_processor, generation_config=generation_config,
)
