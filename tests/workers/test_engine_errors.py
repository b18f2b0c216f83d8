"""Bad input gets a clear error naming the problem, and the engine keeps serving afterwards."""

from __future__ import annotations

import pytest

from mserve.common.images import ImageError
from mserve.common.prompt import PromptBuilder
from tests.helpers import hf_generate, make_image
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams


@pytest.fixture(scope="module")
def llava_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llava"])


@pytest.fixture(scope="module")
def engine(llava_dir) -> Engine:
    return Engine(EngineConfig(llava_dir, dtype="float32", num_blocks=256, max_image_pixels=640 * 480, max_image_bytes=2_000_000))


@pytest.fixture(scope="module")
def builder(llava_dir) -> PromptBuilder:
    return PromptBuilder(llava_dir)


def image_prompt(builder: PromptBuilder) -> list[int]:
    return builder.prepare_text("What is this?", [make_image(64, 64)]).prompt_ids


def test_corrupt_image_bytes(engine, builder):
    with pytest.raises(ImageError, match="cannot read image header"):
        engine.add_request("bad", image_prompt(builder), images=[b"\x89PNG\r\n\x1a\n-not-really-a-png"])
    truncated = make_image(100, 100)[:200]
    with pytest.raises(ImageError, match="cannot decode image"):
        engine.add_request("bad", image_prompt(builder), images=[truncated])


def test_image_over_pixel_limit(engine, builder):
    big = make_image(700, 500)
    with pytest.raises(ImageError, match=r"700x500 = 350000 pixels, over the limit max_image_pixels=307200"):
        engine.add_request("big", image_prompt(builder), images=[big])


def test_image_over_byte_limit(engine, builder):
    with pytest.raises(ValueError, match=r"over the limit max_image_bytes=2000000"):
        engine.add_request("fat", image_prompt(builder), images=[b"\x00" * 2_000_001])


def test_empty_prompt(engine, builder):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match="prompt is empty"):
        builder.prepare_text("   ")


def test_placeholder_and_image_count_mismatch(engine, builder):
    with pytest.raises(ValueError, match="1 image placeholder runs but 0 images"):
        engine.add_request("mismatch", image_prompt(builder), images=[])
    with pytest.raises(ValueError, match="fewer image placeholders than images"):
        builder.family.expand_placeholders([5, 6], [(10, 10)])


def test_invalid_sampling_params():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)


def test_engine_still_serves_after_errors(engine, builder, llava_dir):
    for bad in ([b"junk"], [make_image(700, 500)]):
        with pytest.raises(ValueError):
            engine.add_request("x", image_prompt(builder), images=bad)
    assert not engine.scheduler.sequences() and engine.pool.num_used_blocks == 0
    pp = builder.prepare_text("What is this?", [make_image(64, 64)])
    engine.add_request("good", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=6))
    assert engine.run_until_done()["good"] == hf_generate(llava_dir, pp.prompt_ids, pp.images, 6)
