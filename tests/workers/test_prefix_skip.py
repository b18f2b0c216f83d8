"""An image whose placeholders the cached prefix holds is not encoded, and tokens stay exactly HF's:
a whole-image hit, a partial one (the image is encoded), and blocks evicted after the skip was decided."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.block_pool import BlockTable
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

MAX_NEW = 6
BS = 16


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "glm46v"])  # glm46v: its grid by GLM's own resize
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def turns(model_dir):
    """Turn 1's prompt (an image, then text) and turn 2's: turn 1, its reply and a follow-up question."""
    # GLM: a size its own resize (two frames' budget) grids otherwise than Qwen2-VL's, which the skip must not use
    size = (300, 250) if "glm" in model_dir else (200, 150)
    pp = PromptBuilder(model_dir).prepare_text(PROMPTS[4], [make_image(*size, seed=7)])
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=64, block_size=BS))
    engine.add_request("t1", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    reply = engine.run_until_done()["t1"]
    follow_up = PromptBuilder(model_dir).tokenizer.encode(" And the sky?", add_special_tokens=False)
    return pp.prompt_ids, pp.prompt_ids + reply + follow_up, pp.images


def after_turn_one(model_dir, turns, **overrides) -> Engine:
    first, _, images = turns
    engine = Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 64, "block_size": BS, **overrides}))
    engine.add_request("t1", first, images=images, sampling=SamplingParams(max_tokens=MAX_NEW))
    engine.run_until_done()
    return engine


def image_span(engine: Engine, prompt_ids) -> tuple[int, int]:
    (start, length), = engine.family.image_spans(prompt_ids)
    return start, start + length


def evict_tail(engine: Engine, keep_blocks: int) -> None:
    """Take free blocks until only the first `keep_blocks` of the cached prefix remain (the tail goes first)."""
    pool, table = engine.pool, BlockTable()
    while pool.num_cached_blocks > keep_blocks:
        pool.allocate(table, (len(table.block_ids) + 1) * BS)
    pool.free(table)


def run_turn_two(engine: Engine, turns) -> list[int]:
    _, second, images = turns
    engine.add_request("t2", second, images=images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()["t2"]
    engine.pool.check_integrity()
    return out


def test_whole_image_in_the_cached_prefix_is_not_encoded(model_dir, turns):
    engine = after_turn_one(model_dir, turns)
    first, second, images = turns
    assert image_span(engine, first)[1] <= (len(first) // BS) * BS  # the cached prefix holds the whole image
    encoded = engine.counters["encoded_images"]
    assert run_turn_two(engine, turns) == hf_generate(model_dir, second, images, MAX_NEW)
    assert engine.counters["encoded_images"] == encoded
    assert engine.counters["encodes_skipped_by_prefix"] == 1 and engine.counters["prefix_skip_fallbacks"] == 0


def test_image_partly_in_the_cached_prefix_is_encoded(model_dir, turns):
    engine = after_turn_one(model_dir, turns)
    first, second, images = turns
    start, end = image_span(engine, first)
    keep = end // BS  # the block holding the image's last token is gone: only part of it is cached
    assert start < keep * BS < end
    evict_tail(engine, keep)
    assert run_turn_two(engine, turns) == hf_generate(model_dir, second, images, MAX_NEW)
    assert engine.counters["encoded_images"] == 2 and engine.counters["encodes_skipped_by_prefix"] == 0


def test_prefix_evicted_after_the_skip_encodes_the_image_after_all(model_dir, turns):
    engine = after_turn_one(model_dir, turns)
    first, second, images = turns
    engine.add_request("t2", second, images=images, sampling=SamplingParams(max_tokens=MAX_NEW))
    assert engine.counters["encodes_skipped_by_prefix"] == 1 and engine.counters["encoded_images"] == 1
    evict_tail(engine, 0)  # between the skip and the admission, every prefix block goes
    out = engine.run_until_done()["t2"]
    assert out == hf_generate(model_dir, second, images, MAX_NEW)
    assert engine.counters["encodes_skipped_by_prefix"] == 0 and engine.counters["prefix_skip_fallbacks"] == 1
    assert engine.counters["encoded_images"] == 2
    engine.pool.check_integrity()
