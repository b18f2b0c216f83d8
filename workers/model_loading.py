"""Loading a checkpoint for serving: its own transformers class in the serving dtype, only the half a stage
runs (vision for encode, text for prefill / decode), paged attention on the language model, and a refusal
where transformers would leave weights newly initialized. workers/model_runner.py runs what this loads."""

from __future__ import annotations

import gc
import os

import torch

from mserve.common.checkpoint_files import read_model_config
from mserve.common.serving_defaults import serving_dtype_for
from mserve.workers import paged_attention
from mserve.workers.vision_layers import drop_unread_vision_layers


def resolve_dtype(device: str, dtype: str | None, model_dir: str | os.PathLike | None = None) -> torch.dtype:
    """The torch dtype to load in: the one named, else the serving default for this device and checkpoint
    (common/serving_defaults.py)."""
    return getattr(torch, serving_dtype_for(device, dtype, model_dir))


def _cpu_bf16_matmuls() -> bool:
    """Whether oneDNN runs bfloat16 matrix multiplies on this CPU (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else True
    except RuntimeError:
        return True  # cannot tell: say nothing


# The parts a stage needs: an encoder runs the vision tower + projector only; prefill and decode the
# language model and its head only. Submodule names of the supported families (llava: vision_tower +
# multi_modal_projector; LLaVA-NeXT adds image_newline, the vector it ends each row of tiles with;
# Qwen2-VL, Qwen3-VL: visual; InternVL: vision_tower + multi_modal_projector; SmolVLM: vision_model + connector;
# Video-LLaVA: image_tower + video_tower; DeepSeek-VL: vision_model + aligner; Gemma 4: vision_tower +
# embed_vision, and audio_tower + embed_audio, encoder-side too, dropped from the text stages).
# The language model is `language_model`, or `text_model` in SmolVLM.
PARTS = ("all", "vision", "text")
_VISION_MODULES = ("vision_tower", "multi_modal_projector", "image_newline", "visual", "vision_model", "connector",
                   "image_tower", "video_tower", "aligner", "embed_vision", "audio_tower", "embed_audio")
_TEXT_MODULES = ("language_model", "text_model")


def text_module_name(model: torch.nn.Module) -> str:
    """The attribute of `model.model` that holds the language model."""
    return next(name for name in _TEXT_MODULES if hasattr(model.model, name))


def load_vlm(model_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None, parts: str = "all"):
    """The checkpoint's own model class, in eval mode, with paged attention on the text model.

    `parts` = "vision" or "text" keeps only what that stage runs: the other half is dropped right
    after loading, so the worker's resident memory holds one half of the weights (the load itself
    still reads the whole checkpoint, through transformers' own key mapping)."""
    import transformers

    from mserve.common.served_models import AUDIO_MODEL_TYPES

    if parts not in PARTS:
        raise ValueError(f"parts must be one of {PARTS}, got {parts!r}")
    # An audio-language model is no image-text-to-text one: transformers' multimodal-LM auto class has it.
    auto = "AutoModelForMultimodalLM" if read_model_config(model_dir).get("model_type") in AUDIO_MODEL_TYPES \
        else "AutoModelForImageTextToText"
    model, info = getattr(transformers, auto).from_pretrained(str(model_dir), dtype=resolve_dtype(device, dtype, model_dir),
                                                              output_loading_info=True)
    refuse_unloaded_weights(model_dir, model, info)
    model = StandardLayout.of(model)
    if parts == "text":
        for name in _VISION_MODULES:
            if getattr(model.model, name, None) is not None:
                setattr(model.model, name, None)
    elif parts == "vision":
        setattr(model.model, text_module_name(model), None)
        model.lm_head = None
    if parts != "text":
        drop_unread_vision_layers(model)
    gc.collect()
    return use_paged_attention(model.to(device).eval())


class StandardLayout(torch.nn.Module):
    """A VLM whose parts sit at its top (Llama4ForConditionalGeneration: vision_model, multi_modal_projector,
    and language_model, a whole Llama4ForCausalLM with its own lm_head) seen in the layout every other family
    has and the runner reads: `model.{language_model, vision_model, multi_modal_projector}` and `lm_head`,
    the language model being the text model (hidden states out). The same modules, not copies: the view is
    what the worker holds, so a stage dropping half of it frees that half."""

    def __init__(self, vlm: torch.nn.Module) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.language_model = vlm.language_model.model
        self.model.vision_model = vlm.vision_model
        self.model.multi_modal_projector = vlm.multi_modal_projector
        self.lm_head = vlm.language_model.lm_head
        self.config, self.generation_config = vlm.config, vlm.generation_config

    @classmethod
    def of(cls, vlm: torch.nn.Module) -> torch.nn.Module:
        """`vlm` itself where it has the standard layout, else its view in it."""
        return vlm if hasattr(vlm, "model") else cls(vlm)


def refuse_unloaded_weights(model_dir: str | os.PathLike, model: torch.nn.Module, info: dict) -> None:
    """A checkpoint whose weights transformers leaves missing (newly initialized at random) is refused: the
    model would answer, and differently on every load. transformers converts some layouts by model_type (a
    MoE's per-expert weights into the fused experts), so a config that pairs a model_type with a text model
    whose conversion it does not run (GLM-4.6V's class over GLM-4.5-Air's experts) loads this way."""
    from mserve.common.processor import UnsupportedModelError

    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise UnsupportedModelError(
            f"{model_dir}: transformers leaves {len(missing)} weights of {type(model).__name__} unloaded (newly "
            f"initialized), e.g. {missing[0]}: the checkpoint's weights are not in a layout this class reads")


def use_paged_attention(model):
    """The model's language model reads and writes the paged pool (a model built in memory, e.g. by
    bench/lab/gpu/big.py, is made ready for the engine the same way as a loaded one)."""
    language_model = getattr(model.model, text_module_name(model))
    if language_model is not None:
        # Only the language model reads the paged pool; the vision tower keeps its own attention.
        language_model.config._attn_implementation = paged_attention.ATTN_IMPLEMENTATION
    return model
