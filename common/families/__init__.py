"""What a model family does differently from the generic path, one small module per family.

The generic path (common/model.py, common/processor.py, workers/model_runner.py) covers a family
whose processor places one run of image tokens per image and whose image processor alone prepares
what `get_image_features` takes. A family that differs says how in a `FamilyRules` here; every
field left None keeps the generic behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class FamilyRules:
    # The processor class, for one transformers' top level cannot hand out on this host.
    processor_class: Callable[[], type] | None = None
    # (processor, (width, height)) -> the token ids one image placeholder becomes, when they are not
    # one run of the image token (the image token's count must still be the visual-token count).
    image_placeholder: Callable[[Any, tuple[int, int]], list[int]] | None = None
    # (processor, PIL images) -> the vision tower's inputs, when the image processor alone is not
    # what the processor runs.
    image_inputs: Callable[[Any, Sequence[Any]], Any] | None = None
    # Why the family takes no image (None: images are taken): its processor is then built without an image
    # processor (the tokenizer and chat template still serve text), and image parts are refused at admission.
    no_images: str | None = None
    # Why the family takes no video (None: a video is taken, generically as its frames).
    no_video: str | None = None
    # config.json (a dict) -> what the engine lacks for this checkpoint of the family, or None.
    config_gap: Callable[[dict], str | None] | None = None
    # (config.json, image processor settings, processor) -> what the engine lacks, or None: for gaps
    # only the built processor shows.
    processor_gap: Callable[[dict, dict, Any], str | None] | None = None
    # One image's placeholder tokens attend to each other both ways, on top of causal attention (HF's
    # token_type_ids groups): each image is computed whole in one forward (workers/scheduler.py,
    # workers/paged_attention.py).
    bidirectional_images: bool = False
    # ...on the sliding-window layers only, the full layers staying causal (Gemma 4's "vision" bidirectional
    # attention; Gemma 3's images are bidirectional on every layer).
    bidirectional_images_sliding_only: bool = False
    # text_config (a dict) -> whether this checkpoint's images are bidirectional at all, where the checkpoint
    # decides (Gemma 4: only with use_bidirectional_attention="vision"); None: `bidirectional_images` holds.
    bidirectional_images_if: Callable[[dict], bool] | None = None
    # Why the family is served in float32 only (its reduced-precision tokens not shown to be HF's), or None.
    float32_only: str | None = None
    # The vision tower takes the processor's float32 pixels and casts them itself, after arithmetic of its own
    # (Gemma 4's patch embedder: 2 * (x - 0.5) in float32, then the model's dtype): pixels cast to a reduced
    # dtype first round before that arithmetic, not after, and the image's rows leave HF's bits.
    casts_own_pixels: bool = False

    def pixel_dtype(self, model_dtype: Any) -> Any:
        """The dtype pixel values go to the vision tower in: the model's, or the processor's own (None)."""
        return None if self.casts_own_pixels else model_dtype
    # (rendered prompt, processor, number of images) -> the prompt with each image's placeholder
    # expanded as text, for a processor that expands before tokenizing (neighbouring text merges).
    expand_text: Callable[[str, Any, int], str] | None = None
    # The video processor's class defaults when a video is Qwen3-VL's kind: sampled by the checkpoint's
    # own rule, sized as one clip, and expanded as text with per-frame-group timestamps
    # (common/families/qwen3_vl.py). None: Qwen2-VL's video (one run, common/video.py defaults).
    timestamped_video_defaults: dict | None = None
    # The traits (common/traits.py names: a layer kind, `token_type_mask`, `bidirectional_text`...) this
    # family's code and tests honour; any other trait a checkpoint of it has is refused at load.
    honoured_traits: frozenset[str] = frozenset()
    # (processor, (width, height)) -> an image's (t, h, w) patch grid, when the image processor does not
    # resize by Qwen2-VL's smart_resize (common/model.py's default for M-RoPE families).
    image_grid: Callable[[Any, tuple[int, int]], tuple[int, int, int]] | None = None
    # HF's forward embeds every placeholder token as the pad token (Gemma 4): a prompt's rows take the item's
    # features anyway, a placeholder token the model generates stays pad (workers/text_traits.py).
    placeholders_read_as_pad: bool = False
    # (processor, soft tokens) -> the token ids one audio placeholder becomes, when it is not one run of the
    # audio token (Gemma 4: boa + run + eoa).
    audio_placeholder: Callable[[Any, int], list[int]] | None = None
    # (tokenizer, normalized turns, audio token id) -> the prompt ids, one placeholder per item, for a tokenizer
    # that encodes a chat itself with no chat template (Voxtral's Tekken: families/voxtral.py).
    encode_chat: Callable[[Any, Sequence[dict], int | None], list[int]] | None = None


def rules_for(model_type: str | None) -> FamilyRules:
    from mserve.common.families import gemma3, gemma4, glm4v, llama4, pixtral, qwen3_vl, tiled, voxtral

    return {"mistral3": pixtral.RULES, "gemma3": gemma3.RULES, "gemma4": gemma4.RULES, "internvl": tiled.INTERNVL,
            "smolvlm": tiled.SMOLVLM, "idefics3": tiled.IDEFICS3, "qwen3_vl": qwen3_vl.RULES,
            "qwen3_vl_moe": qwen3_vl.RULES, "glm46v": glm4v.RULES, "glm4v": glm4v.RULES,
            "glm4v_moe": glm4v.RULES, "qwen3_5": HYBRID, "qwen3_5_moe": HYBRID,
            "voxtral": voxtral.RULES, "llama4": llama4.RULES}.get(model_type or "", FamilyRules())


def audio_settings(model_type: str, model_dir: Any, config: dict, processor: Any) -> Any:
    """An audio family's count settings (common/model.py's ModelFamily.audio_features): Voxtral's from its
    Tekken tokenizer (families/voxtral.py), Gemma 4's from its built processor (families/gemma4.py), Qwen2-Audio's
    from its feature extractor (families/qwen2_audio.py)."""
    if model_type == "gemma4":
        from mserve.common.families.gemma4 import audio_features

        return audio_features(processor)
    if model_type == "voxtral":
        from mserve.common.families.voxtral import voxtral_audio

        return voxtral_audio(processor.tokenizer, config, model_dir)
    from mserve.common.families.qwen2_audio import read_audio_features

    return read_audio_features(model_dir)


# Qwen3.5 and its MoE: Gated DeltaNet layers keep a per-sequence state (workers/linear_state.py).
HYBRID = FamilyRules(honoured_traits=frozenset({"linear_attention"}))
