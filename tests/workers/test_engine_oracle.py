"""Every engine path gives exactly the greedy token ids of Hugging Face generate() on the same checkpoint."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from mserve.common.prompt import PromptBuilder
from tests.helpers import PROMPTS, hf_generate, make_image
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.model_loading import load_vlm
from mserve.workers.sequence import SamplingParams

ARCHS = ["llava", "qwen2_vl", "llava_next", "qwen2_5_vl", "mistral3", "qwen3_vl", "qwen3_vl_moe", "glm46v", "glm4v_moe"]
# glm4v (GLM-4.1V) is glm46v's model code and processor under another config class: its engine check is one
# chunked two-image request (tests/common/test_glm4v.py), not this whole module again.
# The scheduler's own mechanics (requests joining, preemption, seeded sampling, stop tokens, the prefill
# chunk cap) do not depend on the family once its prompts and positions are right: they run on one family
# of each position scheme (1-D: llava, M-RoPE: qwen2_vl); every family runs the tests of what it brings
# (its images, chunking and prefix hits across them, the KV hand-off, lean stages, late images).
MECHANICS_ARCHS = ("llava", "qwen2_vl")


def mechanics_only(model_dir) -> None:
    if Path(model_dir).name not in MECHANICS_ARCHS:
        pytest.skip(f"scheduler mechanics: run on {' and '.join(MECHANICS_ARCHS)}")
MAX_NEW = 10


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def new_engine(model_dir: str, **overrides) -> Engine:
    cfg = {"dtype": "float32", "num_blocks": 512, "block_size": 16, "max_num_batched_tokens": 4096, **overrides}
    # An engine only reads its model (KV pool, exact-attention choice and pruner live in its runner): the
    # engines of one checkpoint share one load of the whole model. Lean parts and other dtypes load their own.
    shared = not {"parts", "dtype", "device", "visual_token_pruning"} & overrides.keys()
    return Engine(EngineConfig(model_dir, **cfg), model=whole_model(str(model_dir)) if shared else None)


@lru_cache(maxsize=1)  # this module's tests run one family after another (model_dir is module-scoped)
def whole_model(model_dir: str):
    return load_vlm(model_dir, dtype="float32")


def prepared(builder: PromptBuilder, i: int, n_images: int, size=(200, 150)):
    images = [make_image(size[0] + 37 * k, size[1] + 23 * k, seed=100 * i + k) for k in range(n_images)]
    return builder.prepare_text(PROMPTS[i % len(PROMPTS)], images)


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def check_against_hf(model_dir, requests, results, max_new=MAX_NEW):
    for rid, pp in requests.items():
        expected = hf_generate(model_dir, pp.prompt_ids, pp.images, max_new)
        assert results[rid] == expected, f"{rid}: engine {results[rid]} != HF {expected}"


@pytest.mark.parametrize("n_images", [0, 1, 2], ids=["text-only", "one-image", "two-images"])
def test_single_request_matches_hf(model_dir, builder, n_images):
    pp = prepared(builder, n_images, n_images)
    engine = new_engine(model_dir)
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=greedy())
    results = engine.run_until_done()
    check_against_hf(model_dir, {"r": pp}, results)
    engine.pool.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_images_arriving_after_the_prompt_started_give_hf_tokens(model_dir, builder):
    """A prefill that starts while its second and third images are still encoding elsewhere computes
    the prompt up to the first image it lacks, holds its blocks, and ends exactly as HF does."""
    pp = prepared(builder, 3, 3, size=(96, 80))
    engine = new_engine(model_dir, max_num_batched_tokens=32)  # small chunks: several steps per image
    encoded = engine.encode(pp.images)
    tokens = [int(e.embeds.shape[0]) for e in encoded]
    seq = engine.add_request("r", pp.prompt_ids, encoded=[encoded[0], None, None], item_tokens=tokens,
                             image_hashes=[f"h{i}" for i in range(3)], sampling=greedy())
    second = seq.images[seq.awaiting[1][0]].start  # the first placeholder run of the second image
    stalled = -1
    while seq.num_computed_tokens != stalled:  # run until it stalls on a missing image
        stalled = seq.num_computed_tokens
        assert engine.step() == []  # no token yet: the prompt is not complete
    if engine.family.uses_mrope:  # 3-D positions wait for every grid: only the text before the first image
        assert stalled == seq.images[0].start
    else:
        assert stalled == second  # the first image and the text after it are in
    assert seq.block_table.block_ids and not seq.output_ids  # admitted: its blocks held while it waits
    assert engine.attach_embeddings("r", 2, encoded[2]) and not engine.attach_embeddings("r", 2, encoded[2])
    engine.step()
    assert seq.num_computed_tokens == stalled  # image 1 still missing: no progress
    assert engine.attach_embeddings("r", 1, encoded[1])
    results = engine.run_until_done()
    check_against_hf(model_dir, {"r": pp}, results)
    assert engine.pool.num_used_blocks == 0


def test_ragged_batch_decoded_together(model_dir, builder):
    requests = {f"r{i}": prepared(builder, i, i % 3, size=(120 + 40 * i, 90 + 25 * i)) for i in range(9)}
    assert len({len(p.prompt_ids) for p in requests.values()}) >= 5  # ragged
    engine = new_engine(model_dir)
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    widest = 0
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert widest == len(requests)  # one forward carried every request
    check_against_hf(model_dir, requests, results)
    engine.pool.check_integrity()


def test_requests_join_midway(model_dir, builder):
    mechanics_only(model_dir)
    first = {f"a{i}": prepared(builder, i, 1) for i in range(3)}
    later = {f"b{i}": prepared(builder, i + 4, i % 2) for i in range(3)}
    engine = new_engine(model_dir)
    for rid, pp in first.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    results: dict[str, list[int]] = {}
    for _ in range(4):
        for o in engine.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(0 < len(results[r]) < MAX_NEW for r in first)  # still decoding when the others join
    for rid, pp in later.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    for rid, toks in engine.run_until_done().items():
        results.setdefault(rid, []).extend(toks)
    check_against_hf(model_dir, {**first, **later}, results)


def test_chunked_prefill(model_dir, builder):
    pp = prepared(builder, 2, 1)
    engine = new_engine(model_dir, max_num_batched_tokens=16)
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=greedy())
    steps_before_first_token = 0
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        if not results and not outs:
            steps_before_first_token += 1
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert steps_before_first_token >= len(pp.prompt_ids) // 16 - 1 >= 3
    check_against_hf(model_dir, {"r": pp}, results)


def test_kv_export_import_between_engines(model_dir, builder):
    requests = {f"r{i}": prepared(builder, i, (i % 2) + 1) for i in range(3)}
    prefill = new_engine(model_dir)
    decode = new_engine(model_dir, num_blocks=300)  # a different pool: block ids will differ
    for rid, pp in requests.items():
        prefill.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy(), prefill_only=True)
    first: dict[str, int] = {}
    while prefill.has_unfinished():
        for o in prefill.step():
            assert o.finish_reason == "prefilled"
            first[o.request_id] = o.new_token_ids[0]
    # Occupy a few blocks so the imported request lands on other block ids than it had.
    decode.pool.allocate(_table(), 40)
    for rid in requests:
        payload = prefill.export_kv(rid)
        decode.import_kv(payload)
    assert prefill.pool.num_used_blocks == 0
    results = decode.run_until_done()
    merged = {rid: [first[rid]] + results[rid] for rid in requests}
    check_against_hf(model_dir, requests, merged)


def _table():
    from mserve.workers.block_pool import BlockTable

    return BlockTable()


def test_prefix_cache_reuses_blocks_and_keeps_tokens(model_dir, builder):
    pp = prepared(builder, 4, 1)
    engine = new_engine(model_dir)
    engine.add_request("first", pp.prompt_ids, images=pp.images, sampling=greedy())
    first = engine.run_until_done()["first"]
    seq = engine.add_request("again", pp.prompt_ids, images=pp.images, sampling=greedy())
    again = engine.run_until_done()["again"]
    assert seq.num_cached_tokens >= (len(pp.prompt_ids) - 1) // 16 * 16 > 0
    assert again == first == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    # A different image with the same placeholder ids must not hit the cache.
    other = builder.prepare_text(PROMPTS[4], [make_image(200, 150, seed=999)])
    seq = engine.add_request("other", other.prompt_ids, images=other.images, sampling=greedy())
    engine.run_until_done()
    assert seq.num_cached_tokens < pp.prompt_ids.index(engine.family.image_token_id) + 16


def test_preemption_recomputes_exactly(model_dir, builder):
    mechanics_only(model_dir)
    requests = {f"r{i}": prepared(builder, i, 1) for i in range(4)}
    longest = max(len(p.prompt_ids) for p in requests.values())
    new = 24  # crosses at least one block boundary
    # Room for the two longest prompts and one spare block; reserve_tokens=0 admits on the prompt
    # alone, so decode growth must preempt.
    blocks = 2 * -(-longest // 16) + 1
    engine = new_engine(model_dir, num_blocks=blocks, enable_prefix_caching=False, reserve_tokens=0)
    # A frozen clock: prompt aging runs on wall time, and on a loaded machine it could reorder
    # admissions so that no preemption is needed (the test then asserted nothing it meant to).
    engine.scheduler.clock = lambda: 0.0
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy(new))
    results = engine.run_until_done()
    assert engine.scheduler.num_preemptions > 0
    check_against_hf(model_dir, requests, results, max_new=new)
    engine.pool.check_integrity()


def test_seeded_sampling_is_reproducible_across_engines(model_dir, builder):
    mechanics_only(model_dir)
    pp = prepared(builder, 1, 1)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    outs = []
    for _ in range(2):
        engine = new_engine(model_dir)
        engine.add_request("s", pp.prompt_ids, images=pp.images, sampling=params)
        outs.append(engine.run_until_done()["s"])
    assert outs[0] == outs[1] and len(outs[0]) == 8
    # Split across a prefill engine and a decode engine: same tokens.
    pre, dec = new_engine(model_dir), new_engine(model_dir)
    pre.add_request("s", pp.prompt_ids, images=pp.images, sampling=params, prefill_only=True)
    tok = pre.run_until_done()["s"]
    dec.import_kv(pre.export_kv("s"))
    assert tok + dec.run_until_done()["s"] == outs[0]


def test_stop_token_and_max_tokens(model_dir, builder):
    mechanics_only(model_dir)
    pp = prepared(builder, 0, 0)
    engine = new_engine(model_dir)
    engine.add_request("full", pp.prompt_ids, sampling=greedy(6))
    full = engine.run_until_done()["full"]
    assert len(full) == 6
    engine.add_request("stopped", pp.prompt_ids, sampling=SamplingParams(max_tokens=6, stop_token_ids=(full[2],)))
    stopped = engine.run_until_done()["stopped"]
    assert stopped == full[: full.index(full[2]) + 1]


def test_lean_stage_engines_hold_half_the_weights_and_give_hf_tokens(model_dir, builder):
    """Encode keeps only the vision tower + projector, prefill/decode only the language model + head,
    and encode -> prefill -> decode across the three lean engines still gives HF's tokens."""
    encoder = new_engine(model_dir, parts="vision", num_blocks=16)
    prefill = new_engine(model_dir, parts="text")
    decode = new_engine(model_dir, parts="text", num_blocks=300)
    whole = sum(p.numel() for p in new_engine(model_dir, num_blocks=16).runner.model.parameters())
    n_vision = sum(p.numel() for p in encoder.runner.model.parameters())
    n_text = sum(p.numel() for p in prefill.runner.model.parameters())
    assert encoder.runner.model.model.language_model is None and encoder.runner.kv is None
    assert n_vision + n_text == whole and 0 < n_vision < whole and 0 < n_text < whole
    requests = {f"r{i}": prepared(builder, i, i % 3) for i in range(3)}
    first: dict[str, int] = {}
    for rid, pp in requests.items():
        encoded = encoder.encode(pp.images)
        prefill.add_request(rid, pp.prompt_ids, encoded=encoded, image_hashes=[f"{rid}-{k}" for k in range(len(encoded))],
                            sampling=greedy(), prefill_only=True)
    while prefill.has_unfinished():
        for o in prefill.step():
            first[o.request_id] = o.new_token_ids[0]
    for rid in requests:
        decode.import_kv(prefill.export_kv(rid))
    results = decode.run_until_done()
    check_against_hf(model_dir, requests, {rid: [first[rid]] + results[rid] for rid in requests})


def test_prefill_chunk_cap_interleaves_prompts_with_streams_and_stays_exact(model_dir, builder):
    """The chunk cap path: streams decode in every step while several prompts share a small cap in
    policy order (a short text prompt overtakes a half-prefilled image prompt), all token-exact."""
    mechanics_only(model_dir)
    engine = new_engine(model_dir, max_prefill_tokens=24)
    streams = {f"s{i}": prepared(builder, i, 0) for i in range(2)}
    for rid, pp in streams.items():
        engine.add_request(rid, pp.prompt_ids, sampling=greedy())
    results: dict[str, list[int]] = {}
    first_order: list[str] = []

    def step() -> None:
        for o in engine.step():
            if o.request_id not in results:
                first_order.append(o.request_id)
            results.setdefault(o.request_id, []).extend(o.new_token_ids)

    while not all(r in results for r in streams):
        step()
    prompts = {"img": prepared(builder, 3, 2), "txt": prepared(builder, 7, 0)}
    engine.add_request("img", prompts["img"].prompt_ids, images=prompts["img"].images, sampling=greedy(),
                       latency_class="batch")
    step()  # the image prompt starts (24 tokens of it)
    engine.add_request("txt", prompts["txt"].prompt_ids, sampling=greedy())
    while engine.has_unfinished():
        before = {r: len(results.get(r, [])) for r in streams}
        step()
        # every stream still running got its token in this step, beside at most 24 prompt tokens
        assert all(len(results[r]) == before[r] + 1 for r in streams if before[r] < MAX_NEW)
    assert first_order.index("txt") < first_order.index("img")  # it joined later but finished prefill first
    check_against_hf(model_dir, {**streams, **prompts}, results)
