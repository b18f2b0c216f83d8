"""Tile-splitting families (InternVL, SmolVLM, Idefics3): the engine gives exactly HF generate()'s greedy ids.

One image is several tiles here, and its placeholders can be several runs with text tokens between
them (SmolVLM's row/column markers): ragged batches of differently tiled images, chunks that end
inside an image's placeholders, images that arrive after the prompt started, and prefix-cache hits."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

ARCHS = ["internvl", "smolvlm"]
MAX_NEW = 8
# Sizes that the tiny processors cut into different numbers of tiles (one tile up to six plus a global view).
SIZES = [(20, 20), (100, 60), (300, 40), (113, 57), (200, 150)]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def new_engine(model_dir: str, **overrides) -> Engine:
    cfg = {"dtype": "float32", "num_blocks": 512, "block_size": 16, "max_num_batched_tokens": 4096, **overrides}
    return Engine(EngineConfig(model_dir, **cfg))


def prepared(builder: PromptBuilder, i: int, n_images: int):
    images = [make_image(*SIZES[(i + k) % len(SIZES)], seed=100 * i + k) for k in range(n_images)]
    return builder.prepare_text(PROMPTS[i % len(PROMPTS)], images)


def check_against_hf(model_dir, requests, results):
    for rid, pp in requests.items():
        expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
        assert results[rid] == expected, f"{rid}: engine {results[rid]} != HF {expected}"


def test_ragged_batch_of_differently_tiled_images(model_dir, builder):
    check_ragged_batch(model_dir, builder)


def test_idefics3_ragged_batch(tiny_model_dirs):
    """Idefics3 runs SmolVLM's code path with its own classes (its other paths are SmolVLM's tests)."""
    model_dir = str(tiny_model_dirs["idefics3"])
    check_ragged_batch(model_dir, PromptBuilder(model_dir))


def check_ragged_batch(model_dir: str, builder: PromptBuilder) -> None:
    requests = {f"r{i}": prepared(builder, i, i % 3) for i in range(4)}
    counts = {builder.family.visual_token_count(s) for s in SIZES}
    assert len(counts) >= 3  # the sizes really tile differently
    engine = new_engine(model_dir)
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    widest, results = 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert widest == len(requests)  # one forward carried every request
    check_against_hf(model_dir, requests, results)
    engine.pool.check_integrity()


def test_chunks_ending_inside_an_image_stay_exact(model_dir, builder):
    pp = prepared(builder, 2, 2)
    engine = new_engine(model_dir, max_num_batched_tokens=16)
    seq = engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    cuts = set()
    while engine.has_unfinished():
        engine.step()
        if seq.num_computed_tokens < len(pp.prompt_ids):
            cuts.add(seq.num_computed_tokens)
    assert any(s.start < c < s.end for s in seq.images for c in cuts)  # a chunk ended mid-placeholders
    check_against_hf(model_dir, {"r": pp}, {"r": seq.output_ids})


def test_images_arriving_after_the_prompt_started(model_dir, builder):
    pp = prepared(builder, 3, 2)
    engine = new_engine(model_dir, max_num_batched_tokens=16)
    encoded = engine.encode(pp.images)
    tokens = [int(e.embeds.shape[0]) for e in encoded]
    seq = engine.add_request("r", pp.prompt_ids, encoded=[encoded[0], None], item_tokens=tokens,
                             image_hashes=["h0", "h1"], sampling=SamplingParams(max_tokens=MAX_NEW))
    stalled = -1
    while seq.num_computed_tokens != stalled:
        stalled = seq.num_computed_tokens
        assert engine.step() == []
    assert stalled == seq.images[min(seq.awaiting[1])].start  # everything before image 1's placeholders
    assert engine.attach_embeddings("r", 1, encoded[1])
    results = engine.run_until_done()
    check_against_hf(model_dir, {"r": pp}, results)
    assert engine.pool.num_used_blocks == 0


def test_prefix_cache_hit_keeps_tokens(model_dir, builder):
    pp = prepared(builder, 4, 1)
    engine = new_engine(model_dir)
    engine.add_request("first", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    first = engine.run_until_done()["first"]
    seq = engine.add_request("again", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    again = engine.run_until_done()["again"]
    assert seq.num_cached_tokens >= (len(pp.prompt_ids) - 1) // 16 * 16 > 0
    assert again == first == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    other = builder.prepare_text(PROMPTS[4], [make_image(*SIZES[4], seed=999)])
    assert len(other.prompt_ids) == len(pp.prompt_ids)
    seq = engine.add_request("other", other.prompt_ids, images=other.images, sampling=SamplingParams(max_tokens=2))
    engine.run_until_done()
    assert seq.num_cached_tokens < pp.prompt_ids.index(engine.family.image_token_id) + 16  # another image: no hit


def test_lean_encode_prefill_decode_engines_split_the_weights_and_stay_exact(model_dir, builder):
    """Encode keeps only the vision tower + projector (connector), prefill and decode only the language
    model + head; encode -> prefill -> KV export -> decode gives HF's tokens."""
    from mserve.workers.model_loading import text_module_name

    encoder = new_engine(model_dir, parts="vision", num_blocks=16)
    prefill = new_engine(model_dir, parts="text")
    decode = new_engine(model_dir, parts="text", num_blocks=300)
    whole = sum(p.numel() for p in new_engine(model_dir, num_blocks=16).runner.model.parameters())
    n_vision = sum(p.numel() for p in encoder.runner.model.parameters())
    n_text = sum(p.numel() for p in prefill.runner.model.parameters())
    assert getattr(encoder.runner.model.model, text_module_name(encoder.runner.model)) is None
    assert n_vision + n_text == whole and 0 < n_vision < whole and 0 < n_text < whole
    pp = prepared(builder, 5, 2)
    encoded = encoder.encode(pp.images)
    prefill.add_request("r", pp.prompt_ids, encoded=encoded, image_hashes=["a", "b"],
                        sampling=SamplingParams(max_tokens=MAX_NEW), prefill_only=True)
    first = []
    while prefill.has_unfinished():
        first += [o.new_token_ids[0] for o in prefill.step()]
    decode.import_kv(prefill.export_kv("r"))
    check_against_hf(model_dir, {"r": pp}, {"r": first + decode.run_until_done()["r"]})
