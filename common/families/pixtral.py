"""Mistral 3 (Pixtral vision): an image is rows of [IMG] tokens, each row closed by [IMG_BREAK] and the
last one by [IMG_END]; only the [IMG] tokens take image features (the model scatters its features into
exactly the image-token positions), the break and end tokens are text.

So one image is several runs of the image token: `image_placeholder` lays them out with the processor's
own `replace_image_token`, and the generic spans (one per run, an image covering consecutive runs,
common/hashing.py `item_spans`) carry its features row by row. PixtralProcessor also resizes to
multiples of patch_size * spatial_merge_size itself rather than the image processor's patch_size:
`image_inputs` runs its `_process_images`.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Sequence

import numpy as np

from mserve.common.families import FamilyRules

_TORCH_IMAGE_MODULE = "transformers.models.pixtral.image_processing_pixtral"


def processor_class() -> type:
    """PixtralProcessor. transformers 5's processing_pixtral imports one helper from the torchvision image
    processor module (absent here: no torchvision on CPU hosts); without torchvision that module is
    stood in for by one exposing the PIL module's copy of the same function."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        if _TORCH_IMAGE_MODULE not in sys.modules:
            from transformers.models.pixtral import image_processing_pil_pixtral as pil

            shim = types.ModuleType(_TORCH_IMAGE_MODULE)
            shim.get_resize_output_image_size = pil.get_resize_output_image_size
            sys.modules[_TORCH_IMAGE_MODULE] = shim
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


def resized_size(processor: Any, width: int, height: int) -> tuple[int, int]:
    """(height, width) the processor resizes an image to: the rule of its _get_num_multimodal_tokens."""
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    edge = processor.image_processor.size["longest_edge"]
    patch = processor.patch_size * processor.spatial_merge_size
    # Only the shape is read: a broadcast view allocates no pixels. Channels last, said outright: an image
    # 1 or 3 pixels high would otherwise read as channels first (rows and columns swapped).
    shape_only = np.broadcast_to(np.zeros((), np.uint8), (height, width, 3))
    return get_resize_output_image_size(shape_only, size=(edge, edge), patch_size=(patch, patch),
                                        input_data_format=ChannelDimension.LAST)


def image_placeholder(processor: Any, size: tuple[int, int]) -> list[int]:
    """The token ids one image of (width, height) becomes, laid out by the processor's own rule."""
    text = processor.replace_image_token({"image_sizes": [resized_size(processor, *size)]}, 0)
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def image_inputs(processor: Any, images: Sequence[Any]) -> Any:
    processed, _ = processor._process_images(list(images), return_tensors="pt")
    return processed


def config_gap(config: dict) -> str | None:
    """The paged attention is global: a text model with a sliding window would attend differently."""
    window = (config.get("text_config") or {}).get("sliding_window")
    return None if window is None else f"sliding-window attention (text_config.sliding_window={window})"


RULES = FamilyRules(
    processor_class=processor_class, image_placeholder=image_placeholder, image_inputs=image_inputs,
    config_gap=config_gap,
    no_video="model_type mistral3 takes no video (its processor and chat template take images only)",
)
