"""Gemma 4's own rules (its image path): how an image placeholder expands, and what a checkpoint must not
turn on.

Gemma 4's chat template renders an image as the image token; Gemma4Processor replaces it with
boi + n soft tokens + eoi, n depending on the image's size (an aspect-ratio preserving resize to at
most max_soft_tokens pooled patches). boi and eoi are special tokens, so expanding token by token
gives the ids the processor's text expansion gives. Unlike Gemma 3, an image's soft tokens attend to
each other both ways on the sliding-window layers only, and only in checkpoints with "vision"
bidirectional attention; the full layers stay causal (HF's create_masks_for_vision_model). No torch
here: admission uses this.
"""

from __future__ import annotations

from typing import Any

from mserve.common.families import FamilyRules

MODEL_TYPE = "gemma4"


def processor_class() -> type:
    from transformers import Gemma4Processor

    return Gemma4Processor


def unservable(config: dict[str, Any]) -> str | None:
    """What this Gemma 4 checkpoint turns on that the engine does not serve token-exact, or None. An audio tower
    (E2B, E4B) is no gap: it is never run, and the image path's tokens are HF's with it present; nor are the
    mixture-of-experts layers (26B-A4B): the model's own, row by row (tests/workers/test_engine_gemma4.py)."""
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


RULES = FamilyRules(processor_class=processor_class, image_placeholder=image_placeholder, config_gap=unservable,
                    bidirectional_images=True, bidirectional_images_sliding_only=True,
                    # its images' bidirectional mask (config_gap refuses an all-bidirectional checkpoint)
                    honoured_traits=frozenset({"token_type_mask", "bidirectional_text"}),
                    bidirectional_images_if=images_bidirectional,
                    # bfloat16: its patch embedder's 2 * (x - 0.5) runs on the processor's float32 pixels.
                    casts_own_pixels=True,
                    no_video="video input is not supported for model_type gemma4 (images only)")
