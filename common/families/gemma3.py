"""Gemma 3's own rules: what a checkpoint must not turn on, and how its image placeholder expands.

Gemma 3's chat template renders an image as <start_of_image>; its processor replaces that text with
"\\n\\n<start_of_image>" + image_seq_length x <image_soft_token> + "<end_of_image>\\n\\n" before
tokenizing, so the newlines merge with their neighbours the way the tokenizer merges them. The
prompt is therefore expanded as text, exactly as `Gemma3Processor` does, not token by token.
No torch here: the coordinator uses this at admission.
"""

from __future__ import annotations

from typing import Any

from mserve.common.families import FamilyRules

MODEL_TYPE = "gemma3"


def unservable(config: dict[str, Any], image_processor: dict[str, Any], processor: Any) -> str | None:
    """Why this Gemma 3 checkpoint cannot be served token-exact, or None."""
    text = config.get("text_config") or {}
    if image_processor.get("do_pan_and_scan"):
        return ("pan-and-scan (do_pan_and_scan) adds a varying number of crops per image, which admission "
                "does not count")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            return f"{key} (the paged attention and the engine's head apply no softcapping)"
    if text.get("use_bidirectional_attention"):
        return "use_bidirectional_attention (the text model attends both ways everywhere, not causally)"
    tokens = config.get("mm_tokens_per_image", 256)
    if getattr(processor, "image_seq_length", tokens) != tokens:
        return (f"the processor's image_seq_length {processor.image_seq_length} differs from the model's "
                f"mm_tokens_per_image {tokens}")
    return None


def expand_images_in_text(text: str, processor: Any, num_images: int) -> str:
    """The rendered prompt with each image's <start_of_image> replaced as Gemma3Processor replaces it."""
    marker = processor.image_token  # <start_of_image>, the text placeholder (boi)
    found = text.count(marker)
    if found != num_images:
        raise ValueError(f"gemma3: the prompt has {found} {marker} placeholders for {num_images} images")
    return text.replace(marker, processor.full_image_sequence)


RULES = FamilyRules(processor_gap=unservable, bidirectional_images=True, expand_text=expand_images_in_text,
                    # softcapping and all-bidirectional text: refused by its own processor_gap, naming the key
                    honoured_traits=frozenset({"token_type_mask", "attn_logit_softcapping", "bidirectional_text"}),
                    no_video="video input is not supported for model_type gemma3 (images only)")
