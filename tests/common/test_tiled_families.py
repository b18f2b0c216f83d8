"""Tile-splitting families: admission's prompt ids and visual-token counts are exactly the processor's own.

The count comes from the image header alone (the processor's `_get_num_multimodal_tokens`); the ids
that replace each image from the processor's own expansion text. Both are checked against the full
processor run on decoded pixels, over sizes that tile in many ways."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mserve.common.prompt import PromptBuilder
from tests.helpers import make_frames, make_image

ARCHS = ["internvl", "smolvlm", "idefics3"]
# Tiny, square, wide, tall, extreme, exactly one tile, just over one tile, large.
SIZES = [(20, 20), (56, 56), (57, 57), (100, 60), (60, 100), (113, 57), (300, 40), (40, 300), (1000, 30),
         (200, 150), (500, 500), (64, 700)]


@pytest.fixture(scope="module", params=ARCHS)
def builder(request, tiny_model_dirs) -> PromptBuilder:
    return PromptBuilder(tiny_model_dirs[request.param])


def processor_ids(builder: PromptBuilder, text: str, images: list[bytes]) -> list[int]:
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return list(builder.family.processor(text=[text], images=pil or None)["input_ids"][0])


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_admission_count_and_ids_are_the_processors(builder, size):
    image = make_image(*size)
    pp = builder.prepare_text("Describe.", [image])
    ids = processor_ids(builder, pp.text, [image])
    assert pp.prompt_ids == ids
    assert builder.family.visual_token_count(size) == ids.count(builder.family.image_token_id)


def test_counts_differ_with_the_tiling(builder):
    assert len({builder.family.visual_token_count(s) for s in SIZES}) >= 3


def test_images_between_text_turns_match_the_processor(builder):
    images = [make_image(100, 60, seed=1), make_image(40, 300, seed=2)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": images[0]},
                                             {"type": "text", "text": "and second:"},
                                             {"type": "image", "image": images[1]}, {"type": "text", "text": "Compare."}]}]
    pp = builder.prepare(messages)
    assert pp.prompt_ids == processor_ids(builder, pp.text, images)
    spans = builder.family.image_spans(pp.prompt_ids)
    counts = [builder.family.visual_token_count(s) for s in ((100, 60), (40, 300))]
    assert sum(n for _, n in spans) == sum(counts)


def test_video_is_refused_at_admission_naming_the_family(builder):
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match=f"video input is not supported for model_type {builder.family.model_type}"):
        builder.prepare(video)
