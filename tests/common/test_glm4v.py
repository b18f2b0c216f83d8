"""GLM-4.1V / GLM-4.6V admission: prompt ids, visual-token counts and patch grids are exactly the processor's own.

The count comes from the image header alone (the processor's `_get_num_multimodal_tokens`), the grid a
prefix-cache skip places M-RoPE positions by from GLM's own smart_resize (common/families/glm4v.py); all
are checked against the full processor run on decoded pixels, over sizes where GLM's resize (an image
sized as two frames, small images scaled up) and Qwen's differ."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mserve.common.model import smart_resize
from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_frames, make_image

ARCHS = ["glm46v", "glm4v", "glm4v_moe"]
# Tiny (scaled up), square, wide, tall, extreme, over the pixel budget only as two frames, large.
SIZES = [(20, 20), (27, 90), (56, 56), (100, 60), (60, 100), (300, 40), (40, 300), (1000, 30), (200, 150),
         (300, 250), (500, 500), (64, 700)]


@pytest.fixture(scope="module", params=ARCHS)
def builder(request, tiny_model_dirs) -> PromptBuilder:
    return PromptBuilder(tiny_model_dirs[request.param])


def processed(builder: PromptBuilder, text: str, images: list[bytes]):
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return builder.family.processor(text=[text], images=pil or None, return_tensors="pt")


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_admission_ids_count_and_grid_are_the_processors(builder, size):
    image = make_image(*size)
    pp = builder.prepare_text("Describe.", [image])
    out = processed(builder, pp.text, [image])
    ids = out["input_ids"][0].tolist()
    assert pp.prompt_ids == ids
    assert builder.family.visual_token_count(size) == ids.count(builder.family.image_token_id)
    assert builder.family.image_grid(size) == tuple(out["image_grid_thw"][0].tolist())


def test_glms_resize_is_not_qwens(builder):
    """Not vacuous: on these sizes Qwen2-VL's smart_resize (the default for M-RoPE families) gives other grids."""
    ip = builder.family.processor.image_processor
    factor = ip.patch_size * ip.merge_size
    differ = [s for s in SIZES if builder.family.image_grid(s)[1:] != tuple(
        x // ip.patch_size for x in smart_resize(s[1], s[0], factor, ip.size["shortest_edge"], ip.size["longest_edge"]))]
    assert len(differ) >= 3
    assert len({builder.family.visual_token_count(s) for s in SIZES}) >= 6


def test_images_between_text_turns_match_the_processor(builder):
    images = [make_image(100, 60, seed=1), make_image(40, 300, seed=2)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": images[0]},
                                             {"type": "text", "text": "and second:"},
                                             {"type": "image", "image": images[1]}, {"type": "text", "text": "Compare."}]},
                {"role": "assistant", "content": "Two pictures."},
                {"role": "user", "content": "Which is taller?"}]
    pp = builder.prepare(messages)
    assert pp.prompt_ids == processed(builder, pp.text, images)["input_ids"][0].tolist()
    assert pp.text.startswith("[gMASK]<sop><|user|>\n")  # GLM's BOS comes from the template


def test_video_is_refused_at_admission_naming_why(builder):
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match="GLM-4V video .* is not built by mserve yet"):
        builder.prepare(video)


def test_two_images_in_chunks_ending_inside_them_give_hf_tokens(builder):
    """Each GLM class through the engine once (the generic oracle runs glm46v and glm4v_moe in full)."""
    pp = builder.prepare_text(PROMPTS[3], [make_image(300, 250, seed=5), make_image(60, 100, seed=6)])
    spans = builder.family.image_spans(pp.prompt_ids)
    cuts = range(16, len(pp.prompt_ids), 16)  # where 16-token chunks end
    assert len(spans) == 2 and all(any(start < cut < start + length for cut in cuts) for start, length in spans)
    engine = Engine(EngineConfig(builder.model_dir, dtype="float32", num_blocks=64, block_size=16, max_num_batched_tokens=16))
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=10))
    assert engine.run_until_done()["r"] == hf_generate(builder.model_dir, pp.prompt_ids, pp.images, 10)
