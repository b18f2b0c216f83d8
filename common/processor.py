"""Builds a checkpoint's own transformers processor from its parts, the one way every family is loaded.

`AutoProcessor.from_pretrained` raises ImportError here for every processor that owns a video
processor (those need torchvision, which CPU hosts do not install). The processor is therefore
assembled from what it is made of: the tokenizer, the family's PIL image processor
(`AutoImageProcessor(backend="pil")`) and the processor's own settings saved in
processor_config.json. The video processor is left out (`None`); admission sizes videos with
common/video.py. The processor then answers the exact visual-token count per image size
(`_get_num_multimodal_tokens`), the same hook vLLM uses, without decoding a pixel.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from mserve.common.checkpoint_files import PROCESSOR_FILE, read_model_config


class UnsupportedModelError(ValueError):
    """A checkpoint the generic path cannot serve: the message is one line naming what is missing."""


def processor_class(model_type: str) -> type:
    """The processor class transformers pairs with this model_type (its auto mapping)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from mserve.common.families import rules_for

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    load = rules_for(model_type).processor_class
    cls = load() if load is not None else getattr(transformers, name, None) if name else None
    if cls is None:
        raise UnsupportedModelError(f"model_type {model_type!r}: transformers has no processor class for it")
    from mserve.common.served_models import AUDIO_MODEL_TYPES

    if not hasattr(cls, "_get_num_multimodal_tokens") and model_type not in AUDIO_MODEL_TYPES:  # audio: families/
        raise UnsupportedModelError(f"model_type {model_type!r}: {cls.__name__} has no _get_num_multimodal_tokens, "
                                    "so the visual-token count per image cannot be known at admission")
    return cls


def processor_settings(model_dir: str | os.PathLike, cls: type) -> dict[str, Any]:
    """The processor's own keys from processor_config.json (not its sub-processors), as its __init__ takes them."""
    path = Path(model_dir) / PROCESSOR_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    params = inspect.signature(cls.__init__).parameters
    subs = set(cls.get_attributes()) | {"chat_template"}
    return {k: v for k, v in data.items() if k in params and k not in subs}


# Parts a processor owns that the image path never runs: the video processor (it needs torchvision) and an
# audio feature extractor (one of a checkpoint without an audio tower; a served one's is loaded: has_audio_tower).
# They are built as None (and so is the image processor of a family whose images are refused).
_LEFT_OUT = ("video_processor", "feature_extractor")


def build_processor(model_dir: str | os.PathLike, model_type: str, tokenizer: Any = None) -> Any:
    """The checkpoint's processor, with the PIL image processor and no video processor."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    from mserve.common.families import rules_for
    from mserve.common.served_models import has_audio_tower

    cls = processor_class(model_type)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    attributes = cls.get_attributes()
    # A family whose images are refused (FamilyRules.no_images: Llama 4's image processor needs torchvision)
    # is built without its image processor: the tokenizer and chat template are what its text path runs.
    left_out = _LEFT_OUT + (("image_processor",) if rules_for(model_type).no_images is not None else ())
    parts: dict[str, Any] = {"tokenizer": tokenizer}
    if "image_processor" in attributes and "image_processor" not in left_out:
        parts["image_processor"] = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    if "feature_extractor" in attributes and has_audio_tower(model_type, read_model_config(model_dir)):
        parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(str(model_dir))
    missing = [a for a in attributes if a not in parts and a not in left_out]
    if missing:
        raise UnsupportedModelError(f"model_type {model_type!r}: {cls.__name__} needs {', '.join(missing)}, "
                                    "which mserve does not load")
    parts.update({a: None for a in attributes if a in left_out and a not in parts})
    return assemble_processor(cls, **parts, **processor_settings(model_dir, cls))


def assemble_processor(cls: type, **kwargs: Any) -> Any:
    """cls(**kwargs), with the parts mserve leaves out passed as None."""
    processor = cls.__new__(cls)
    # ProcessorMixin type-checks each part, and the check of a video processor imports torchvision: a
    # None part left out is accepted on this one instance (video sizing lives in common/video.py).
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = (
        lambda name, arg: type(None) if arg is None else check(name, arg))
    processor.__init__(**kwargs)
    del processor.check_argument_for_proper_class
    return processor


def image_token_count(processor: Any, width: int, height: int) -> int:
    """Exact placeholder tokens of one image of (width, height), from the processor's own rule."""
    data = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
    return int(data.num_image_tokens[0])
