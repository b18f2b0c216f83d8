"""Voxtral (mistralai/Voxtral-Mini-3B-2507 layout): a Whisper-style audio tower over 30 s chunks, a
projector that stacks 4 consecutive frames into one token (1500 frames -> 375 tokens per chunk), a
Llama text model, and VoxtralProcessor on a Tekken tokenizer (mistral_common's tekken.json, no chat
template: mistral_common encodes the chat request itself).

The tokenizer is written here offline: the published file's control tokens at their ranks ([AUDIO] 24
and [BEGIN_AUDIO] 25, which VoxtralProcessor assumes; [TRANSCRIBE] 34), the 256 byte tokens, then the
merges of the shared tiny BPE, and the published audio settings (16 kHz, 12.5 tokens per second, 30 s
chunks). Only the mel bins shrink, as the tower does; the chunk stays 30 s because VoxtralProcessor
pads every clip to a multiple of 480000 samples whatever the checkpoint says.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path

from mserve.common.tiny_families.base import TinyFamily, train_bpe

SAMPLING_RATE, HOP_LENGTH, CHUNK_S, FRAME_RATE = 16000, 160, 30, 12.5
NUM_SPECIAL_TOKENS = 100
# The published tekken.json's first control tokens (mistral_common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS
# order), then Voxtral's audio ones at their published ranks; the ranks between are fillers.
_CONTROL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]
_AUDIO_CONTROL = {24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]"}
# mistral_common's Tekken pre-tokenizer pattern (the published v7 files').
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _special_tokens() -> list[dict]:
    names = {**dict(enumerate(_CONTROL)), **_AUDIO_CONTROL}
    return [{"rank": i, "token_str": names.get(i, f"<SPECIAL_{i}>"), "is_control": True}
            for i in range(NUM_SPECIAL_TOKENS)]


def _byte_vocab(size: int) -> list[dict]:
    """The 256 byte tokens (rank = byte, as tiktoken requires), then the tiny BPE's merges in its order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decode = {c: b for b, c in bytes_to_unicode().items()}
    bpe = train_bpe(size, [], []).get_vocab()
    merged = [bytes(decode[c] for c in piece) for piece, _ in sorted(bpe.items(), key=lambda kv: kv[1])]
    pieces = [bytes([i]) for i in range(256)] + [p for p in merged if len(p) > 1]
    return [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": None}
            for i, p in enumerate(pieces[:size])]


def tekken_file(vocab_size: int, num_mel_bins: int) -> dict:
    """A tekken.json of `vocab_size` ids in all, NUM_SPECIAL_TOKENS of them control tokens."""
    vocab = _byte_vocab(vocab_size - NUM_SPECIAL_TOKENS)
    return {
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": vocab_size,
                   "default_num_special_tokens": NUM_SPECIAL_TOKENS, "version": "v7"},
        "vocab": vocab, "special_tokens": _special_tokens(),
        "audio": {"sampling_rate": SAMPLING_RATE, "frame_rate": FRAME_RATE, "chunk_length_s": float(CHUNK_S),
                  "audio_encoding_config": {"num_mel_bins": num_mel_bins, "hop_length": HOP_LENGTH,
                                            "window_size": 400}},
    }


def voxtral_tokenizer(vocab_size: int, num_mel_bins: int = 16):
    """MistralCommonBackend on a fresh tekken.json (saving the processor copies the file)."""
    from transformers import MistralCommonBackend

    folder = Path(tempfile.mkdtemp(prefix="mserve-tekken-"))
    (folder / "tekken.json").write_text(json.dumps(tekken_file(vocab_size, num_mel_bins)))
    return MistralCommonBackend.from_pretrained(str(folder))


def voxtral_config(dims: dict, tok, std: float):
    from transformers import VoxtralConfig

    # The projector reads the tower's frames as rows of its ffn width (intermediate_size): 4 * d_model, as
    # published, stacks 4 frames into one token (1500 frames -> 375 tokens per chunk).
    audio = dict(num_mel_bins=dims["mel_bins"], encoder_layers=dims["a_layers"], encoder_attention_heads=dims["a_heads"],
                 intermediate_size=4 * dims["a_hidden"], d_model=dims["a_hidden"],
                 max_source_positions=CHUNK_S * SAMPLING_RATE // HOP_LENGTH // 2, initializer_range=std)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
                num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                head_dim=dims["hidden"] // dims["heads"], max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4}, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                initializer_range=std)
    return VoxtralConfig(audio_config=audio, text_config=text, audio_token_id=tok.convert_tokens_to_ids("[AUDIO]"))


def save_voxtral_processor(out: Path, dims: dict, tok, layout: str) -> None:
    """processor_config.json (the feature extractor nested) and tekken.json from VoxtralProcessor.save_pretrained;
    the hub's preprocessor_config.json beside it unless `layout` is "processor"."""
    from transformers import VoxtralProcessor, WhisperFeatureExtractor

    features = WhisperFeatureExtractor(feature_size=dims["mel_bins"], sampling_rate=SAMPLING_RATE,
                                       hop_length=HOP_LENGTH, chunk_length=CHUNK_S, n_fft=400, padding_value=0.0)
    VoxtralProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(out)
    if layout != "processor":
        features.save_pretrained(out)


def generation_config(tok):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


VOXTRAL = TinyFamily(
    arch="voxtral",
    dims={"tiny": dict(mel_bins=16, a_hidden=32, a_layers=2, a_heads=2,
                       hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
          "small": dict(mel_bins=128, a_hidden=256, a_layers=4, a_heads=4,
                        hidden=512, inter=1376, layers=8, heads=8, kv_heads=4)},
    init_std={"tiny": 0.3, "small": 0.15},
    tokenizer=voxtral_tokenizer, config=voxtral_config, save_processor=save_voxtral_processor,
    generation_config=generation_config, model_class="AutoModelForMultimodalLM",
)
