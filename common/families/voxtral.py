"""Voxtral: its tokenizer (mistral_common's Tekken, MistralCommonBackend) encodes a chat itself, audio
included, with no chat template; its audio token count is that tokenizer's arithmetic.

mistral_common pads a clip at the tokenizer's rate to a whole number of `chunk_length_s` chunks and
gives it [BEGIN_AUDIO] and one [AUDIO] per `frame_rate`-th of a second of the padded clip
(AudioConfig.num_audio_tokens); VoxtralProcessor pads the features the same way and the tower turns
each chunk into that many rows. Both counts are the tokenizer's own objects, read here without torch.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from mserve.common.families import FamilyRules


@dataclass(frozen=True)
class VoxtralAudio:
    """The tokenizer's audio settings (mistral_common's AudioConfig) as common/model.py asks for them."""

    config: Any  # mistral_common.tokens.tokenizers.audio.AudioConfig

    @property
    def sampling_rate(self) -> int:
        return int(self.config.sampling_rate)

    @property
    def min_seconds(self) -> float:
        return 1 / self.sampling_rate  # one sample pads to a whole chunk

    def tokens(self, samples: int) -> int:
        """[AUDIO] tokens of a clip of `samples` samples at `sampling_rate` (0 for an empty one)."""
        chunk = self.config.chunk_frames
        return self.config.num_audio_tokens(math.ceil(samples / chunk) * chunk)


def audio_config(tokenizer: Any) -> Any:
    """The Tekken tokenizer's audio settings (None for a tokenizer without audio)."""
    encoder = tokenizer.tokenizer.instruct_tokenizer.audio_encoder
    return None if encoder is None else encoder.audio_config


@lru_cache(maxsize=4)
def _stand_in_clip(rate: int) -> str:
    """One silent sample at the tokenizer's rate (no resampling) as a base64 WAV: mistral_common needs a
    clip to place an audio's tokens."""
    import base64
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate), w.writeframes(b"\0\0")
    return base64.b64encode(buf.getvalue()).decode()


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], audio_token_id: int) -> list[int]:
    """The prompt ids mistral_common encodes for `messages` (common/prompt.py's normalized turns), each
    clip's [AUDIO] run cut to one token for ModelFamily.expand_placeholders to expand by its own count."""
    turns, rate = [], int(audio_config(tokenizer).sampling_rate)
    for msg in messages:
        parts = [{"type": "audio", "base64": _stand_in_clip(rate)} if p["type"] == "audio" else p for p in msg["content"]]
        if msg["role"] != "user":  # mistral_common takes system and assistant turns as text
            parts = "".join(p["text"] for p in parts if p["type"] == "text")
        turns.append({"role": msg["role"], "content": parts})
    ids = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
    return [t for i, t in enumerate(ids) if t != audio_token_id or ids[i - 1] != audio_token_id]


RULES = FamilyRules(encode_chat=encode_chat)


def voxtral_audio(tokenizer: Any, config: dict, model_dir: Any) -> VoxtralAudio:
    """The checkpoint's audio settings, refused at load (CheckpointError) when its tower and its tokenizer
    disagree on a chunk's tokens (the tower: max_source_positions frames, stacked intermediate_size //
    hidden_size to a token)."""
    from mserve.common.checkpoint_files import CheckpointError

    settings = audio_config(tokenizer)
    if settings is None or settings.chunk_length_s is None:
        raise CheckpointError(f"{model_dir}/tekken.json has no audio settings with chunk_length_s")
    audio = VoxtralAudio(settings)
    tower = config.get("audio_config") or {}
    try:
        rows = tower["max_source_positions"] * tower["hidden_size"] // tower["intermediate_size"]
    except KeyError as exc:
        raise CheckpointError(f"{model_dir}/config.json: audio_config has no {exc}") from None
    if rows != (per_chunk := audio.tokens(1)):
        raise CheckpointError(f"{model_dir}: the audio tower gives {rows} rows per chunk, tekken.json's audio "
                              f"settings {per_chunk} tokens")
    return audio
