"""Qwen2-Audio: a Whisper-style audio tower (conv stem, stride-2 conv, 2x average pool) and a Qwen2 text
model; Whisper's log-mel feature extractor and Qwen2AudioProcessor, as Qwen/Qwen2-Audio-7B-Instruct.

The tiny sizes shorten Whisper's 30 s window (chunk_length) so the tower stays small; the tower's
max_source_positions follows it (frames / 2), as the real checkpoint's 1500 follows 30 s at 100 frames/s.
"""

from __future__ import annotations

from pathlib import Path

from mserve.common.tiny_families.base import TinyFamily, train_bpe

QWEN2_AUDIO_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
SAMPLING_RATE, HOP_LENGTH = 16000, 160  # Whisper's feature extractor: 100 log-mel frames per second


def chat_template() -> str:
    """Qwen2-Audio-7B-Instruct's template, as transformers keeps it (Qwen2AudioProcessor.default_chat_template)."""
    from transformers import Qwen2AudioProcessor

    return Qwen2AudioProcessor.default_chat_template.fget(None)


def qwen2_audio_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, [], QWEN2_AUDIO_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
                              "audio_eos_token": "<|audio_eos|>"},
        padding_side="left", chat_template=chat_template(),
    )


def qwen2_audio_config(dims: dict, tok, std: float):
    from transformers import Qwen2AudioConfig

    audio = dict(
        num_mel_bins=dims["mel_bins"], encoder_layers=dims["a_layers"], encoder_attention_heads=dims["a_heads"],
        encoder_ffn_dim=dims["a_ffn"], d_model=dims["a_hidden"], activation_function="gelu",
        max_source_positions=dims["chunk_length"] * SAMPLING_RATE // HOP_LENGTH // 2, initializer_range=std,
    )
    text = dict(
        model_type="qwen2", vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, initializer_range=std,
    )
    return Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
                            tie_word_embeddings=False)


def save_qwen2_audio_processor(out: Path, dims: dict, tok, layout: str) -> None:
    """processor_config.json (the feature extractor nested), tokenizer and chat template from
    Qwen2AudioProcessor.save_pretrained; the hub's preprocessor_config.json beside it unless `layout`
    is "processor". Qwen2-Audio has no image processor: "preprocessor" is the same as "both"."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    features = WhisperFeatureExtractor(feature_size=dims["mel_bins"], sampling_rate=SAMPLING_RATE,
                                       hop_length=HOP_LENGTH, chunk_length=dims["chunk_length"], n_fft=400,
                                       padding_value=0.0, return_attention_mask=True)
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok, chat_template=chat_template()).save_pretrained(out)
    if layout != "processor":
        features.save_pretrained(out)


def generation_config(tok):
    from transformers import GenerationConfig

    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[tok.eos_token_id, endoftext], pad_token_id=endoftext)


QWEN2_AUDIO = TinyFamily(
    arch="qwen2_audio",
    dims={"tiny": dict(mel_bins=16, chunk_length=3, a_hidden=32, a_layers=2, a_heads=2, a_ffn=64,
                       hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
          "small": dict(mel_bins=80, chunk_length=10, a_hidden=256, a_layers=4, a_heads=4, a_ffn=1024,
                        hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=qwen2_audio_tokenizer, config=qwen2_audio_config, save_processor=save_qwen2_audio_processor,
    generation_config=generation_config, model_class="AutoModelForMultimodalLM",
)
