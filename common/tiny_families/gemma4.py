"""Gemma 4: its own vision tower (patches with 2-D positions, pooled k x k), a text model with per-layer
embeddings, KV sharing, wider global layers, and bidirectional attention inside an image on its
sliding-window layers only.

Every trait that sets Gemma 4 apart is on, at a size where a shortcut would change tokens:
- six layers, sliding and full in turn, the last two reusing layers 2 and 3's K/V (num_kv_shared_layers=2),
  so both layer types store and reuse, and a full layer's output still feeds a layer that computes its
  own K/V (with layers 2 and 3 already shared, how a full layer attends inside an image would change no
  token: nothing after it reads its image rows' outputs);
- a 12-token window, shorter than every test prompt and than an image (30-70 soft tokens);
- full layers with their own head size (global_head_dim 32 against 16) and one K=V head
  (attention_k_eq_v), so the KV pool's layers differ in shape;
- "proportional" rope on full layers (a quarter of the dims rotate), default rope on sliding ones;
- per-layer embeddings (hidden_size_per_layer_input 8);
- final logit softcapping at 2.0, where tanh bends the tiny model's logits.
Images keep their aspect ratio: 4-pixel patches pooled 2 x 2, at most 70 soft tokens, so the count
depends on the image's size. An audio tower (E2B's kind: a 2-conv stem, conformer layers with chunked local
attention, a projection) behind Gemma4AudioFeatureExtractor's 16 kHz log-mel frames: 25 soft tokens a second.
"""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import TinyFamily, save_processor_files
from mserve.common.tiny_families.gemma3 import gemma_tokenizer

# The audio tokens too: Gemma4Processor refuses every call when the tokenizer lacks boa/eoa (as the published
# tokenizer has them), audio or not.
# <|video|> is in the vocabulary as in the published one: Gemma4Processor adds it to the tokenizer otherwise.
SPECIALS = ["<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>",
            "<|video|>"]

# Written for mserve after the published Gemma 4 template's shape (not a copy): BOS first; turns open with
# <|turn> + role and close with <turn|>; assistant turns are "model" turns; an image part is the image token,
# which the processor expands to <|image> + soft tokens + <image|>; an audio part is the audio token, which it
# expands to <|audio> + soft tokens + <audio|>.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|image|>' }}"
    "{%- elif part['type'] == 'audio' -%}{{ '<|audio|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"
)


def gemma4_tokenizer(vocab_size: int):
    return gemma_tokenizer(vocab_size, SPECIALS,
                           {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                            "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"},
                           GEMMA4_CHAT_TEMPLATE)


def gemma4_config(dims: dict, tok, std: float):
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"], num_hidden_layers=dims["v_layers"],
        num_attention_heads=dims["v_heads"], num_key_value_heads=dims["v_heads"],
        head_dim=dims["v_hidden"] // dims["v_heads"], patch_size=dims["patch"], pooling_kernel_size=dims["pool"],
        position_embedding_size=dims["positions"], initializer_range=std,
    )
    # The conv stem's projection assumes mel bins = 4 x its first channel count (128 and 128 in E2B).
    audio = Gemma4AudioConfig(
        hidden_size=dims["a_hidden"], num_hidden_layers=dims["a_layers"], num_attention_heads=dims["a_heads"],
        subsampling_conv_channels=[dims["mel_bins"], dims["a_channels"]], output_proj_dims=dims["a_out"],
        initializer_range=std,
    )
    head_dim = dims["hidden"] // dims["heads"]
    text = Gemma4TextConfig(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=len(dims["layer_types"]), num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], head_dim=head_dim, global_head_dim=dims["global_head_dim"],
        num_global_key_value_heads=dims["global_kv_heads"], attention_k_eq_v=True,
        sliding_window=dims["sliding_window"], layer_types=dims["layer_types"], max_position_embeddings=4096,
        num_kv_shared_layers=dims["kv_shared"], use_bidirectional_attention="vision",
        hidden_size_per_layer_input=dims["per_layer"], vocab_size_per_layer_input=len(tok),
        final_logit_softcapping=dims["softcap"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=std,
    )
    ids = tok.convert_tokens_to_ids
    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio, boi_token_id=ids("<|image>"),
        eoi_token_id=ids("<image|>"), image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        audio_token_id=ids("<|audio|>"), boa_token_id=ids("<|audio>"), eoa_token_index=ids("<audio|>"),
        initializer_range=std,
    )


def save_gemma4_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    from mserve.common.families.gemma4 import processor_class
    from mserve.common.processor import assemble_processor

    image_processor = Gemma4ImageProcessorPil(patch_size=dims["patch"], pooling_kernel_size=dims["pool"],
                                              max_soft_tokens=dims["max_soft_tokens"])
    features = Gemma4AudioFeatureExtractor(feature_size=dims["mel_bins"])  # 16 kHz, 20 ms frames, 10 ms hops
    # No video processor (torchvision).
    processor = assemble_processor(processor_class(), feature_extractor=features, image_processor=image_processor,
                                   tokenizer=tok, video_processor=None, image_seq_length=dims["max_soft_tokens"],
                                   audio_seq_length=dims["audio_seq_length"], chat_template=GEMMA4_CHAT_TEMPLATE)
    # save_pretrained writes every part it owns: the part left out (None) is not listed on this instance.
    processor.get_attributes = lambda: ["feature_extractor", "image_processor", "tokenizer"]
    save_processor_files(out, processor, image_processor, layout)


def generation_config(tok):
    from transformers import GenerationConfig

    end_of_turn = tok.convert_tokens_to_ids("<turn|>")
    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                            pad_token_id=tok.pad_token_id)


_LAYERS = ["sliding_attention", "full_attention"] * 3
_TINY = dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, patch=4, pool=2, positions=160, max_soft_tokens=70,
             hidden=64, inter=128, heads=4, kv_heads=2, global_head_dim=32, global_kv_heads=1, sliding_window=12,
             layer_types=_LAYERS, kv_shared=2, per_layer=8, softcap=2.0,
             mel_bins=16, a_channels=8, a_hidden=32, a_layers=2, a_heads=2, a_out=48, audio_seq_length=750)
_SMALL = dict(_TINY, v_hidden=128, v_inter=512, v_layers=4, v_heads=4, patch=8, max_soft_tokens=140, hidden=256,
              inter=768, global_head_dim=128, sliding_window=64,
              layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
              + ["full_attention"], kv_shared=3, per_layer=32, softcap=30.0,
              mel_bins=32, a_channels=16, a_hidden=128, a_layers=4, a_heads=4, a_out=256)

GEMMA4 = TinyFamily(
    arch="gemma4",
    dims={"tiny": _TINY, "small": _SMALL},
    init_std={"tiny": 0.05, "small": 0.03},
    tokenizer=gemma4_tokenizer, config=gemma4_config, save_processor=save_gemma4_processor,
    generation_config=generation_config,
)
