"""The token ids one image placeholder becomes, for families whose processor wraps or interleaves its
context tokens: InternVL (<img> + context tokens + </img>) and SmolVLM / Idefics3 (per tile a row/column marker
and its context tokens, then the global image).

Each family's own processor writes the text (its `replace_image_token`, fed the tiling its image
processor computes from the size alone), and the tokenizer turns it into ids: the text starts and
ends with special tokens, so tokenizing it alone gives the ids it gets inside the whole prompt.
Families not listed here repeat the image token `visual_token_count` times (common/model.py).
Their videos are refused: each processor expands a video unlike an image (InternVL: "FrameN:" lines
without tiling; SmolVLM: timestamps and one global view per frame; Idefics3 has none).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Sequence

from mserve.common.families import FamilyRules


def _internvl_text(processor: Any, width: int, height: int) -> str:
    patches = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_patches[0]
    return processor.replace_image_token({"num_patches": [patches]}, 0)


def _smolvlm_text(processor: Any, width: int, height: int) -> str:
    kwargs = processor._merge_kwargs()["images_kwargs"]
    _, rows, cols = processor.image_processor.get_number_of_image_patches(height, width, kwargs)
    return processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)


_TEXT: dict[str, Callable[[Any, int, int], str]] = {
    "internvl": _internvl_text,
    "smolvlm": _smolvlm_text,
    "idefics3": _smolvlm_text,  # the same tiling and text as SmolVLM
}


@lru_cache(maxsize=256)
def _ids(model_type: str, processor: Any, width: int, height: int) -> tuple[int, ...]:
    text = _TEXT[model_type](processor, width, height)
    return tuple(processor.tokenizer(text, add_special_tokens=False)["input_ids"])


def image_prompt_ids(model_type: str, processor: Any, size: tuple[int, int]) -> list[int]:
    """The ids the processor puts in place of one image of (width, height)."""
    return list(_ids(model_type, processor, *size))


def _one_sample_per_image(processor: Any, images: Sequence[Any]) -> Any:
    """SmolVLM and Idefics3 get one sample per image, so that its features come back one entry per image."""
    return processor.image_processor(images=[[im] for im in images], return_tensors="pt")


def _rules(model_type: str, **kw: Any) -> FamilyRules:
    return FamilyRules(image_placeholder=partial(image_prompt_ids, model_type),
                       no_video=f"video input is not supported for model_type {model_type} (images only)", **kw)


INTERNVL = _rules("internvl")
SMOLVLM = _rules("smolvlm", image_inputs=_one_sample_per_image)
IDEFICS3 = _rules("idefics3", image_inputs=_one_sample_per_image)
