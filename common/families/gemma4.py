"""Gemma 4's own rules (its image path): how an image placeholder expands, and what a checkpoint must not
turn on.

Gemma 4's chat template renders an image as the image token; Gemma4Processor replaces it with
boi + n soft tokens + eoi, n depending on the image's size (an aspect-ratio preserving resize to at
most max_soft_tokens pooled patches). boi and eoi are special tokens, so expanding token by token
gives the ids the processor's text expansion gives. Unlike Gemma 3, an image's soft tokens attend to
each other both ways on the sliding-window layers only, and only in checkpoints with "vision"
bidirectional attention; the full layers stay causal (HF's create_masks_for_vision_model).

Its audio (E2B, E4B: a checkpoint with an audio_config): the template's audio token becomes boa + n audio soft
tokens + eoa, n from Gemma4AudioFeatureExtractor's framing and the tower's two stride-2 convs
(`AudioFeatures.tokens`); audio soft tokens attend causally (HF's block mask groups image and video tokens
only). No torch here: admission uses this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mserve.common.families import FamilyRules

MODEL_TYPE = "gemma4"


def processor_class() -> type:
    from transformers import Gemma4Processor

    return Gemma4Processor


def unservable(config: dict[str, Any]) -> str | None:
    """What this Gemma 4 checkpoint turns on that the engine does not serve token-exact, or None. An audio tower
    (E2B, E4B) is no gap (tests/workers/test_engine_audio_families.py); nor are the mixture-of-experts layers
    (26B-A4B): the model's own, row by row (tests/workers/test_engine_gemma4.py)."""
    text = config.get("text_config") or {}
    if text.get("use_bidirectional_attention") == "all":
        return "use_bidirectional_attention='all' (the text model attends both ways everywhere, not causally)"
    return None


def image_placeholder(processor: Any, size: tuple[int, int]) -> list[int]:
    """boi + the image's soft tokens + eoi, by the processor's own replace_image_token."""
    from mserve.common.processor import image_token_count

    count = image_token_count(processor, *size)
    text = processor.replace_image_token({"num_soft_tokens_per_image": [count]}, 0)
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def images_bidirectional(text: dict[str, Any]) -> bool:
    """Whether an image's soft tokens attend both ways (on the sliding layers): HF's Gemma4Model builds that mask
    only for use_bidirectional_attention="vision"; without it (the smaller checkpoints) images are causal."""
    return text.get("use_bidirectional_attention") == "vision"


@dataclass(frozen=True)
class AudioFeatures:
    """What a clip's soft-token count depends on: Gemma4AudioFeatureExtractor's framing and the processor's cap.
    The count is Gemma4Processor's: log-mel frames of the clip left-padded by half a frame (a frame counts when
    it ends inside the clip), then two stride-2 convs (kernel 3, padding 1), at most `seq_length`; the extractor
    cuts a clip to `max_samples` first (its __call__'s max_length, 30 s)."""

    sampling_rate: int
    frame_length: int  # samples per frame
    hop_length: int  # samples per hop
    seq_length: int  # the processor's audio_seq_length: at most this many soft tokens a clip
    max_samples: int = 480_000

    @property
    def min_seconds(self) -> float:
        """The shortest clip that gives one token: one whole frame after the half-frame pad."""
        return (self.frame_length - self.frame_length // 2 + 1) / self.sampling_rate

    def tokens(self, samples: int) -> int:
        n = min(samples, self.max_samples)
        frames = (n + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1
        if frames <= 0:
            return 0
        for _ in range(2):
            frames = (frames - 1) // 2 + 1
        return min(frames, self.seq_length)


def audio_features(processor: Any) -> AudioFeatures:
    """The settings of the checkpoint's own feature extractor and processor, as transformers built them."""
    fe = processor.feature_extractor
    return AudioFeatures(sampling_rate=int(fe.sampling_rate), frame_length=int(fe.frame_length),
                         hop_length=int(fe.hop_length), seq_length=int(processor.audio_seq_length))


def audio_placeholder(processor: Any, count: int) -> list[int]:
    """boa + `count` audio soft tokens + eoa, as Gemma4Processor.replace_audio_token writes them."""
    text = f"{processor.boa_token}{processor.audio_token * count}{processor.eoa_token}"
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


RULES = FamilyRules(processor_class=processor_class, image_placeholder=image_placeholder, config_gap=unservable,
                    bidirectional_images=True, bidirectional_images_sliding_only=True,
                    # its images' bidirectional mask (config_gap refuses an all-bidirectional checkpoint)
                    honoured_traits=frozenset({"token_type_mask", "bidirectional_text"}),
                    audio_placeholder=audio_placeholder, placeholders_read_as_pad=True,
                    bidirectional_images_if=images_bidirectional,
                    # bfloat16: its patch embedder's 2 * (x - 0.5) runs on the processor's float32 pixels.
                    casts_own_pixels=True,
                    no_video="video input is not supported for model_type gemma4 (images only)")
