"""Qwen3.5's hybrid text model on the engine: Gated DeltaNet layers keep a per-sequence state beside the
paged K/V of the full-attention layers (workers/linear_state.py). HF generate (float32) is the oracle for
text, one and two images, a ragged batch and a prompt prefilled in chunks that end inside an image."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.linear_state import state_bytes_per_sequence
from mserve.workers.sequence import SamplingParams
from mserve.workers.sizing import read_geometry
from tests.helpers import PROMPTS, hf_generate, make_image

MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen3_5"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def engine(model_dir: str, **config) -> Engine:
    return Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 128, "block_size": 16, **config}))


def run(model_dir: str, pp, **config) -> list[int]:
    e = engine(model_dir, **config)
    e.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = e.run_until_done()["r"]
    assert len(e.runner.linear_states) == 0  # the finished request's state is freed
    return out


def test_pool_holds_kv_of_the_full_layers_only_and_state_per_sequence(model_dir):
    e = engine(model_dir)
    text = e.runner.model.config.text_config
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"]
    assert e.runner.kv.owned == full and len(full) == 1  # K/V for the full layer alone; None for the others
    assert [i for i, k in enumerate(e.runner.kv.k) if k is not None] == full
    assert e.runner.linear_states.layers == [0, 1, 2, 4]
    # 4 layers x (conv: (2*2*16 + 4*16) channels x 4 taps x 4 bytes + recurrent: 4 heads x 16 x 16 x 4 bytes)
    assert state_bytes_per_sequence(text, e.runner.dtype) == 4 * (128 * 4 * 4 + 4 * 16 * 16 * 4) == 24576
    geometry = read_geometry(model_dir)  # what sizing plans with: K/V of the full layer, the state beside it
    assert geometry.num_layers == 1 and geometry.state_bytes_per_sequence(4) == 24576
    assert geometry.state_bytes_per_sequence(2) == 4 * (128 * 4 * 2 + 4 * 16 * 16 * 4)  # bf16 conv, f32 recurrent
    # ... and what a live sequence's state really takes
    e.add_request("r", [1, 2, 3, 4, 5], sampling=SamplingParams(max_tokens=2), prefill_only=True)
    e.run_until_done()
    assert sum(t.nbytes for t in e.runner.linear_states.export("r")) == 24576


@pytest.mark.parametrize("images", [0, 1, 2], ids=["text", "one_image", "two_images"])
def test_matches_hf_generate(model_dir, builder, images):
    pictures = [make_image(200, 120, seed=2), make_image(90, 150, seed=5)][:images]
    pp = builder.prepare_text(PROMPTS[1 + images], pictures)
    assert run(model_dir, pp) == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)


def test_ragged_batch(model_dir, builder):
    """Several sequences in one step: prompt chunks and decode tokens of different requests, each with its state."""
    prompts = {"image": builder.prepare_text(PROMPTS[3], [make_image(150, 100, seed=7)]),
               "text": builder.prepare_text(PROMPTS[4]), "short": builder.prepare_text(PROMPTS[3])}
    e = engine(model_dir, max_num_batched_tokens=48)
    for i, (rid, pp) in enumerate(prompts.items()):
        e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW + i))
    out = e.run_until_done()
    for i, (rid, pp) in enumerate(prompts.items()):
        assert out[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW + i), rid
    assert e.counters["steps"] < sum(len(v) for v in out.values())  # they did share steps


def test_decode_tokens_step_together_each_state_back_in_its_sequence(model_dir, builder):
    """A decode step runs the linear layers once for all its decode tokens (LinearStates' DecodeBatch): beside
    an engine running each sequence alone, in lockstep, every live sequence's state stays the same after every
    step (a row copied back into another sequence's cache would not), through prompts at different lengths,
    a prompt chunk beside the decode batch and sequences leaving it; the tokens are HF generate's."""
    import torch

    prompts = {"short": builder.prepare_text(PROMPTS[3]), "mid": builder.prepare_text(PROMPTS[2]),
               "long": builder.prepare_text(PROMPTS[4])}
    batched, alone = engine(model_dir, max_num_batched_tokens=40), engine(model_dir, max_num_batched_tokens=40)
    alone.runner.linear_states.batch_decode = False
    for e in (batched, alone):
        for i, (rid, pp) in enumerate(prompts.items()):
            e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=4 + 3 * i))
    out: dict[str, list[int]] = {}
    while batched.has_unfinished():
        got = [(o.request_id, o.new_token_ids) for o in batched.step()]
        assert got == [(o.request_id, o.new_token_ids) for o in alone.step()]
        for rid, ids in got:
            out.setdefault(rid, []).extend(ids)
        for rid in prompts:
            if rid in batched.runner.linear_states:
                for mine, theirs in zip(batched.runner.linear_states.export(rid), alone.runner.linear_states.export(rid)):
                    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=rid)
    assert not alone.has_unfinished() and batched.runner.linear_states.batched_tokens > 2 * len(prompts)
    assert alone.runner.linear_states.batched_tokens == 0
    for i, (rid, pp) in enumerate(prompts.items()):
        assert out[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, 4 + 3 * i), rid


def test_chunked_prefill_ending_inside_the_image(model_dir, builder):
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    assert start % 8 and length > 8  # 8-token chunks start and end inside the image
    assert run(model_dir, pp, max_num_batched_tokens=8) == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)


def test_prefix_hit_resumes_from_the_state_snapshot_at_a_block_boundary(model_dir, builder, caplog):
    """Every prompt leaves a copy of its linear layers' state at its last full block before its last token
    (the scheduler ends a chunk there); a repeated prompt, and a second turn extending the first, reuse the
    blocks up to that boundary and resume from the copy: HF's tokens, with only the rest computed."""
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    with caplog.at_level("INFO", logger="mserve.workers.engine"):
        e = engine(model_dir)
    assert "prefix caching with state snapshots" in caplog.text and "layers [0, 1, 2, 4]" in caplog.text
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    boundary = (len(pp.prompt_ids) - 1) // 16 * 16
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    assert start + length < boundary  # the hit covers the whole image
    for rid, cached in (("first", 0), ("again", boundary)):
        seq = e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
        assert e.run_until_done()[rid] == expected
        assert seq.num_cached_tokens == cached
    states = e.runner.linear_states
    assert states.snapshots_restored == 1 and len(states) == 0
    # A second turn: the first turn's prompt, its answer and a new question, on the same image.
    turn2 = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])  # same ids as pp
    ids = pp.prompt_ids + expected + turn2.prompt_ids[-12:]
    seq = e.add_request("turn2", ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    assert e.run_until_done()["turn2"] == hf_generate(model_dir, ids, pp.images, MAX_NEW)
    assert seq.num_cached_tokens >= boundary


def test_a_hit_resumed_from_a_fresh_state_would_change_the_tokens(model_dir, builder):
    """Not vacuous: a shortcut that reused the blocks but started the linear layers from zero, as a pool that
    ignored their state would, moves the greedy tokens off HF's."""
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    e = engine(model_dir)
    e.runner.restore = lambda seq, block_hash: e.runner.linear_states.for_chunk(seq.request_id, 0)
    e.scheduler.restore = e.runner.restore
    for rid in ("first", "again"):
        seq = e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
        out = e.run_until_done()[rid]
    assert seq.num_cached_tokens > 0 and out != hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)


def test_snapshots_off_turns_prefix_reuse_off(model_dir, builder, caplog):
    """state_snapshots=0: no copy to resume from, so no hit is ever served (or published) with a wrong state."""
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    with caplog.at_level("INFO", logger="mserve.workers.engine"):
        e = engine(model_dir, state_snapshots=0)
    assert "prefix caching off" in caplog.text and "linear-attention layers [0, 1, 2, 4]" in caplog.text
    assert e.config.enable_prefix_caching is False and e.scheduler.enable_prefix_caching is False
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    for rid in ("a", "b"):
        seq = e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
        assert e.run_until_done()[rid] == expected
        assert seq.num_cached_tokens == 0


def test_preempted_request_recomputes_its_state(model_dir, builder):
    """Room for two prompts and a spare block, admission on the prompt alone: decode growth preempts, the
    victim's state is dropped with its blocks and recomputed from its first token."""
    prompts = {f"r{i}": builder.prepare_text(PROMPTS[i]) for i in (2, 4, 9)}
    longest = max(len(p.prompt_ids) for p in prompts.values())
    e = engine(model_dir, num_blocks=2 * -(-longest // 16) + 1, reserve_tokens=0)
    e.scheduler.clock = lambda: 0.0  # prompt aging on wall time could reorder admissions so none is needed
    for rid, pp in prompts.items():
        e.add_request(rid, pp.prompt_ids, sampling=SamplingParams(max_tokens=24))
    out = e.run_until_done()
    assert e.scheduler.num_preemptions > 0 and e.runner.linear_states.batched_tokens > 0
    for rid, pp in prompts.items():
        assert out[rid] == hf_generate(model_dir, pp.prompt_ids, [], 24), rid
    assert len(e.runner.linear_states) == 0


@pytest.mark.parametrize("buffers", [False, True], ids=["own_tensors", "allocated"])
def test_prefill_here_decode_there_carries_the_linear_state(model_dir, builder, buffers):
    """export_kv hands on the full layers' blocks and the linear layers' state; decode in another engine
    (another pool, other block ids) continues with HF's tokens. `allocated`: written into buffers the
    caller allocates, as a transfer engine's shared memory."""
    import torch

    prompts = {"image": builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)]),
               "text": builder.prepare_text(PROMPTS[4])}
    prefill, decode = engine(model_dir), engine(model_dir, num_blocks=300)
    for rid, pp in prompts.items():
        prefill.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW),
                            prefill_only=True)
    first = {}
    while prefill.has_unfinished():
        for o in prefill.step():
            assert o.finish_reason == "prefilled"
            first[o.request_id] = o.new_token_ids[0]
    alloc = (lambda spec: {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in spec.items()}) if buffers else None
    for rid in prompts:
        export = prefill.export_kv(rid, alloc=alloc)
        assert len(export.linear_state) == 2 * 4  # conv + recurrent for each of the 4 linear layers
        decode.import_kv(export)
    assert len(prefill.runner.linear_states) == 0 and prefill.pool.num_used_blocks == 0
    out = decode.run_until_done()
    for rid, pp in prompts.items():
        assert [first[rid]] + out[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW), rid


def test_import_without_the_linear_state_is_refused(model_dir, builder):
    pp = builder.prepare_text(PROMPTS[4])
    prefill, decode = engine(model_dir), engine(model_dir)
    prefill.add_request("r", pp.prompt_ids, sampling=SamplingParams(max_tokens=MAX_NEW), prefill_only=True)
    prefill.run_until_done()
    export = prefill.export_kv("r")
    export.linear_state = []
    with pytest.raises(ValueError, match="linear-attention state"):
        decode.import_kv(export)
    assert decode.pool.num_used_blocks == 0 and not decode.has_unfinished()


def test_visual_token_count_from_the_header_is_the_processors_and_the_encoders(model_dir, builder):
    """Admission counts an image's tokens from its header alone: for several sizes (below the minimum, odd,
    wide, over the pixel budget) that equals transformers' image processor's grid and the encoder's rows."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    from mserve.common.images import image_size_from_header

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    encoder = engine(model_dir, parts="vision", num_blocks=4)
    counts = []
    for size in [(64, 48), (300, 200), (500, 120), (17, 301), (256, 256), (640, 480)]:
        data = make_image(*size)
        ours = builder.family.visual_token_count(image_size_from_header(data))
        grid = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")["image_grid_thw"][0]
        (encoded,) = encoder.encode([data])
        assert ours == int(grid.prod()) // processor.merge_size ** 2 == encoded.embeds.shape[0], size
        counts.append(ours)
    assert len(set(counts)) >= 4  # the sizes really exercise smart_resize's bounds (the minimum, the budget)


@pytest.mark.parametrize("exact", [True, None], ids=["exact_attention", "padded_default"])
def test_bf16_ragged_batch_matches_hf_bf16(model_dir, builder, exact):
    """bfloat16, the serving default where the hardware has it natively (the linear layers' conv state in
    bf16, their recurrent state in float32 as transformers keeps it): with exact attention HF bf16's ids;
    padded (the default), HF bf16's up to HF's first top-2 tie (common/exactness.py)."""
    from mserve.common.exactness import compare_greedy
    from tests.helpers import hf_generate_top2, request_mix

    prompts = {f"r{i}": builder.prepare_text(t, ims) for i, (t, ims) in enumerate(request_mix(4, seed=5))}
    e = engine(model_dir, dtype="bfloat16", num_blocks=256, max_num_batched_tokens=4096, exact_attention=exact)
    for rid, pp in prompts.items():
        e.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=12))
    out = e.run_until_done()
    for rid, pp in prompts.items():
        want, top2 = hf_generate_top2(model_dir, pp.prompt_ids, pp.images, 12, dtype="bfloat16")
        assert (out[rid] == want) if exact else compare_greedy(want, out[rid], top2, "bfloat16").exact, rid


def test_abort_mid_prompt_frees_the_state_and_the_others_go_on(model_dir, builder):
    """A request aborted between two of its prompt chunks leaves no state behind; one beside it still gets
    HF's tokens."""
    keep, drop = builder.prepare_text(PROMPTS[4]), builder.prepare_text(PROMPTS[9])
    e = engine(model_dir, max_num_batched_tokens=16)
    e.add_request("drop", drop.prompt_ids, sampling=SamplingParams(max_tokens=MAX_NEW))
    e.add_request("keep", keep.prompt_ids, sampling=SamplingParams(max_tokens=MAX_NEW))
    out: dict[str, list[int]] = {}
    for o in e.step():
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert "drop" in e.runner.linear_states and e.scheduler.get("drop").num_computed_tokens < len(drop.prompt_ids)
    assert e.abort("drop") and "drop" not in e.runner.linear_states
    for rid, tokens in e.run_until_done().items():
        out.setdefault(rid, []).extend(tokens)
    assert out["keep"] == hf_generate(model_dir, keep.prompt_ids, [], MAX_NEW) and "drop" not in out
    assert len(e.runner.linear_states) == 0 and e.pool.num_used_blocks == 0


def test_moe_sibling_matches_hf_with_two_images_and_across_the_hand_off(tiny_model_dirs):
    """Qwen3.5-MoE: the same hybrid attention over sparse MLPs (tests/workers/test_engine_moe.py pins that its
    routing matters). Two images in one prompt, and a prefill here / decode there carrying the state."""
    model_dir = str(tiny_model_dirs["qwen3_5_moe"])
    pp = PromptBuilder(model_dir).prepare_text(PROMPTS[3], [make_image(200, 120, seed=2), make_image(90, 150, seed=5)])
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    assert run(model_dir, pp) == expected
    prefill, decode = engine(model_dir), engine(model_dir)
    prefill.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW),
                        prefill_only=True)
    first = []
    while prefill.has_unfinished():  # two chunks: one ends at the last full block (its state snapshot)
        first += [o.new_token_ids[0] for o in prefill.step()]
    decode.import_kv(prefill.export_kv("r"))
    assert first + decode.run_until_done()["r"] == expected
