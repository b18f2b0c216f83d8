"""Llama 4: a text model of chunked local attention (RoPE) layers beside global NoPE layers, with
Llama 4's qk L2 norm, attention temperature tuning and mixture-of-experts layers; its vision tower tiles
images with an image processor that needs torchvision (common/families/llama4.py: its images are refused).

Every trait that sets Llama 4's text model apart is on, at a size where a shortcut would change tokens:
- a 12-token attention chunk, shorter than every test prompt and not a multiple of a 16-token KV block
  or an 8-token prefill chunk, on three RoPE layers (no_rope_layers), with the qk L2 norm (use_qk_norm);
- a global NoPE layer whose queries are scaled by position (attn_temperature_tuning) at floor_scale 4 and
  attn_scale 0.5, so the scale grows every 4 tokens of a short prompt (published: 8192 and 0.1);
- every second layer a mixture of experts (interleave_moe_layer_step 2): a sigmoid router choosing two of
  eight experts per token (published: one), beside a shared expert.
The processor files are Llama4Processor's with its image processor's settings as saved, written without
building Llama4ImageProcessor (its only backend is torchvision); the chat template is Llama4Processor's.
"""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import PATCH_SIZE, TinyFamily, save_processor_files, train_bpe, with_stand_ins

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>",
            "<|python_start|>", "<|python_end|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>",
            "<|tile_x_separator|>", "<|tile_y_separator|>", "<|finetune_right_pad|>"]


def _chat_template() -> str:
    from transformers.models.llama4.processing_llama4 import chat_template

    return chat_template


def llama4_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    # Llama 4's special tokens follow its BPE vocabulary; the chat template writes BOS itself.
    tok = train_bpe(vocab_size, [], SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot|>", pad_token="<|finetune_right_pad|>",
        extra_special_tokens={"image_token": "<|image|>"}, padding_side="left", chat_template=_chat_template(),
    )


def llama4_config(dims: dict, tok, std: float):
    from transformers import Llama4Config

    vision = dict(hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
                  num_attention_heads=dims["v_heads"], image_size=dims["tile"], patch_size=PATCH_SIZE,
                  vision_output_dim=dims["v_out"], projector_input_dim=dims["v_out"],
                  projector_output_dim=dims["v_out"], initializer_range=std)
    text = dict(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["expert_inter"],
        intermediate_size_mlp=dims["inter"], num_hidden_layers=len(dims["no_rope_layers"]),
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
        num_local_experts=dims["experts"], num_experts_per_tok=dims["experts_per_tok"],
        interleave_moe_layer_step=2, no_rope_layers=list(dims["no_rope_layers"]), use_qk_norm=True,
        attention_chunk_size=dims["chunk"], attn_temperature_tuning=True, floor_scale=dims["floor_scale"],
        attn_scale=0.5, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=std,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    ids = tok.convert_tokens_to_ids
    return Llama4Config(vision_config=vision, text_config=text, image_token_index=ids("<|image|>"),
                        boi_token_index=ids("<|image_start|>"), eoi_token_index=ids("<|image_end|>"))


def save_llama4_processor(out: Path, dims: dict, tok, layout: str) -> None:
    """Llama4Processor's files: its image processor's settings as Llama4ImageProcessor saves them (a stand-in:
    the class itself needs torchvision), the tokenizer and the chat template."""
    from transformers import Llama4Processor

    settings = dict(image_processor_type="Llama4ImageProcessor", do_convert_rgb=True, do_normalize=True,
                    do_rescale=True, do_resize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                    max_patches=4, resample=2, rescale_factor=1 / 255, resize_to_max_canvas=False,
                    size={"height": dims["tile"], "width": dims["tile"]})
    processor = with_stand_ins(Llama4Processor, {"image_processor": settings}, tokenizer=tok, patch_size=PATCH_SIZE,
                               chat_template=_chat_template())
    image_processor = processor.image_processor
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    ends = [tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom|>", "<|eot|>")]
    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=ends, pad_token_id=tok.pad_token_id)


# Three chunked RoPE layers then a global NoPE one (the published no_rope_layer_interval 4), MoE at 1 and 3.
_TINY = dict(v_hidden=32, v_inter=64, v_layers=1, v_heads=2, v_out=64, tile=56, hidden=64, inter=128,
             expert_inter=64, heads=4, kv_heads=2, head_dim=16, experts=8, experts_per_tok=2,
             no_rope_layers=(1, 1, 1, 0), chunk=12, floor_scale=4)
_SMALL = dict(_TINY, v_hidden=128, v_inter=512, v_layers=2, v_heads=4, v_out=256, hidden=512, inter=1376,
              expert_inter=344, heads=8, kv_heads=4, head_dim=64, experts=16, experts_per_tok=2,
              no_rope_layers=(1, 1, 1, 0) * 2, chunk=256, floor_scale=64)

LLAMA4 = TinyFamily(
    arch="llama4",
    dims={"tiny": _TINY, "small": _SMALL},
    init_std={"tiny": 0.15, "small": 0.05},
    tokenizer=llama4_tokenizer, config=llama4_config, save_processor=save_llama4_processor,
    generation_config=generation_config,
)
