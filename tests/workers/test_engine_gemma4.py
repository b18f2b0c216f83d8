"""Gemma 4 through the engine: exactly HF generate's greedy tokens. The tiny model turns on what sets Gemma 4
apart (common/tiny_families/gemma4.py): images bidirectional on its 12-token sliding-window layers only,
KV-shared layers, wider global layers (a KV pool whose layers differ in shape), per-layer embeddings,
softcapped logits, and a soft-token count that depends on the image's size (30-70 here)."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.block_pool import BlockTable
from tests.helpers import PROMPTS, hf_generate, make_image
from tests.workers.test_engine_gemma3 import recorded_chunks
from tests.workers.test_engine_oracle import MAX_NEW, check_against_hf, greedy, new_engine


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["gemma4"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


@pytest.fixture(scope="module")
def requests(builder):
    """Text-only, one image and two images of different sizes, each prompt longer than the sliding window."""
    out = {}
    for i in range(4):
        images = [make_image(120 + 40 * i + 37 * k, 90 + 25 * i, seed=100 * i + k) for k in range(i % 3)]
        out[f"r{i}"] = builder.prepare_text(PROMPTS[i], images)
    window = builder.family.text_config["sliding_window"]
    assert all(len(p.prompt_ids) > window for p in out.values())
    assert [n for _, n in builder.family.image_spans(out["r2"].prompt_ids)] == [70, 60]  # counts vary by size
    return out


def test_ragged_batch_matches_hf(model_dir, requests):
    engine = new_engine(model_dir)
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    widest, results = 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert widest == len(requests)  # one forward carried every request
    check_against_hf(model_dir, requests, results)
    engine.pool.check_integrity()


def test_chunked_prefill_keeps_each_image_in_one_chunk_and_matches_hf(model_dir, requests):
    """Chunks of 8 tokens, smaller than an image: each image is still computed in one forward."""
    requests = {rid: requests[rid] for rid in ("r1", "r2")}  # one image, two images
    engine = new_engine(model_dir, max_num_batched_tokens=8)
    chunks = recorded_chunks(engine)
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    results = engine.run_until_done()
    check_against_hf(model_dir, requests, results)
    images_whole = 0
    for seq, start, end in chunks:
        assert not any(s.start < end < s.end for s in seq.images), (seq.request_id, start, end)
        images_whole += sum(start <= s.start and s.end <= end for s in seq.images)
    assert images_whole == sum(len(p.images) for p in requests.values())


def test_prefix_cache_hit_cut_to_an_image_start_matches_hf(model_dir, requests):
    """The prompt's cached blocks are evicted down to a prefix ending inside its first image: the same
    prompt again starts from the blocks before that image and gives HF's tokens."""
    pp = requests["r2"]  # two images
    bs = 4
    engine = new_engine(model_dir, block_size=bs, num_blocks=96)
    engine.add_request("first", pp.prompt_ids, images=pp.images, sampling=greedy())
    first = engine.run_until_done()["first"]
    seq = engine.add_request("whole", pp.prompt_ids, images=pp.images, sampling=greedy())
    assert engine.run_until_done()["whole"] == first
    assert seq.num_cached_tokens == (len(pp.prompt_ids) - 1) // bs * bs  # every full prompt block reused
    image = engine.family.image_spans(pp.prompt_ids)[0]
    keep = image[0] // bs + 2  # cached blocks kept: the last one ends inside the image
    assert image[0] < keep * bs < image[0] + image[1]
    scratch = BlockTable()  # takes every free block but the prompt's first `keep` (evicted last)
    engine.pool.allocate(scratch, (engine.pool.num_free_blocks - keep) * bs)
    engine.pool.free(scratch)
    seq = engine.add_request("cut", pp.prompt_ids, images=pp.images, sampling=greedy())
    assert engine.run_until_done()["cut"] == first == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    assert seq.num_cached_tokens == image[0] // bs * bs
    engine.pool.check_integrity()


def test_lean_prefill_and_decode_engines_match_hf(model_dir, requests):
    """Encode keeps the vision tower + embed_vision only, prefill/decode the text model; the KV blocks (layers of
    two shapes, the KV-shared layers' not stored twice) move between pools."""
    encoder = new_engine(model_dir, parts="vision", num_blocks=16)
    prefill, decode = new_engine(model_dir, parts="text"), new_engine(model_dir, parts="text", num_blocks=300)
    assert encoder.runner.model.model.language_model is None
    assert prefill.runner.model.model.vision_tower is None and prefill.runner.model.model.embed_vision is None
    kv = prefill.runner.kv
    assert len({tuple(k.shape[2:]) for k in kv.k}) == 2  # sliding and global layers differ
    assert kv.owned == [0, 1, 2, 3] and kv.k[4] is kv.k[2] and kv.v[5] is kv.v[3]  # KV-shared: no pool of their own
    assert kv.export_shape(1)[0] == 4
    chosen = {rid: requests[rid] for rid in ("r0", "r1", "r2")}
    first = {}
    for rid, pp in chosen.items():
        encoded = encoder.encode(pp.images)
        prefill.add_request(rid, pp.prompt_ids, encoded=encoded, image_hashes=[f"{rid}-{k}" for k in range(len(encoded))],
                            sampling=greedy(), prefill_only=True)
    while prefill.has_unfinished():
        for o in prefill.step():
            first[o.request_id] = o.new_token_ids[0]
    for rid in chosen:
        decode.import_kv(prefill.export_kv(rid))
    results = decode.run_until_done()
    check_against_hf(model_dir, chosen, {rid: [first[rid]] + results[rid] for rid in chosen})


def test_hf_reference_depends_on_the_bidirectional_image_groups(model_dir, requests):
    """The oracle is sensitive to what these tests check: without mm_token_type_ids, HF attends causally
    inside images and its greedy tokens differ on this two-image prompt."""
    import copy
    import io

    import torch
    from PIL import Image

    from tests.helpers import reference_model

    pp = requests["r2"]
    model, processor = reference_model(model_dir)
    ids = torch.tensor([pp.prompt_ids])
    pixels = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in pp.images], return_tensors="pt")
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = MAX_NEW, False
    with torch.inference_mode():
        causal = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                                image_position_ids=pixels["image_position_ids"],
                                generation_config=config)[0, ids.shape[1]:].tolist()
    assert causal != hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)


def test_first_step_logits_are_hfs_softcapped_ones(model_dir, requests):
    """Greedy tokens cannot see the softcap (tanh keeps the order): the logits the sampler gets can. The engine's
    logits after a one-image prompt equal HF forward's, which the tiny model's cap of 2.0 bends well away
    from the raw head's."""
    import io

    import torch
    from PIL import Image

    from tests.helpers import reference_model

    pp = requests["r1"]
    engine = new_engine(model_dir)
    got, execute = [], engine.runner.execute
    engine.runner.execute = lambda chunks: got.append(execute(chunks)) or got[-1]
    engine.add_request("x", pp.prompt_ids, images=pp.images, sampling=greedy(1))
    engine.run_until_done()
    model, processor = reference_model(model_dir)
    ids = torch.tensor([pp.prompt_ids])
    pixels = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in pp.images], return_tensors="pt")
    head = []  # the raw head's output, before HF softcaps it
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: head.append(out[0, -1].clone()))
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                        image_position_ids=pixels["image_position_ids"],
                        mm_token_type_ids=(ids == model.config.image_token_id).int())
    finally:
        hook.remove()
    raw = head[0]
    cap = model.config.text_config.final_logit_softcapping
    assert torch.allclose(got[0][0], out.logits[0, -1], rtol=0, atol=1e-5)
    assert (raw - out.logits[0, -1]).abs().max() > 100 * 1e-5 and out.logits.abs().max() < cap


def test_checkpoints_with_experts_and_an_audio_tower_serve_their_image_path_as_hf(tmp_path, requests):
    """Gemma 4 26B-A4B adds mixture-of-experts blocks beside each MLP; E2B and E4B carry an audio tower. One tiny
    checkpoint with both: the experts run as the model runs them, in a ragged batch and in chunks of 8; the
    audio tower is not run on image prompts and the text stages drop it; the tokens are HF's."""
    import dataclasses

    from transformers import Gemma4AudioConfig

    from mserve.common.tiny_families import FAMILIES, gemma4
    from mserve.common.tiny_model import make_tiny_model

    def with_experts_and_audio(dims, tok, std):
        config = gemma4.gemma4_config(dims, tok, std)
        text = config.text_config
        text.enable_moe_block, text.num_experts, text.top_k_experts, text.moe_intermediate_size = True, 4, 2, 32
        config.audio_config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                subsampling_conv_channels=[8, 4], output_proj_dims=32,
                                                conv_kernel_size=3, initializer_range=std)
        return config

    family = dataclasses.replace(gemma4.GEMMA4, config=with_experts_and_audio)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, "gemma4", family)
        model_dir = str(make_tiny_model(tmp_path / "gemma4-moe-audio", "gemma4"))
    for overrides, chosen in (({}, ("r0", "r1", "r2", "r3")), ({"max_num_batched_tokens": 8}, ("r2",))):
        engine = new_engine(model_dir, **overrides)
        assert engine.runner.model.model.audio_tower is not None
        assert engine.runner.model.model.language_model.layers[0].enable_moe_block
        for rid in chosen:
            engine.add_request(rid, requests[rid].prompt_ids, images=requests[rid].images, sampling=greedy())
        check_against_hf(model_dir, {rid: requests[rid] for rid in chosen}, engine.run_until_done())
    text_only = new_engine(model_dir, parts="text", num_blocks=16)
    assert text_only.runner.model.model.audio_tower is None and text_only.runner.model.model.embed_audio is None


def test_a_checkpoint_without_vision_bidirectional_attention_keeps_images_causal(model_dir, tmp_path, requests):
    """Gemma 4's smaller checkpoints leave use_bidirectional_attention unset: HF then attends causally inside
    images too (mm_token_type_ids or not), and so must the engine. Same weights, that one setting changed."""
    import json
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "gemma4-causal")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = None
    (folder / "config.json").write_text(json.dumps(config))
    engine = new_engine(str(folder))
    assert not engine.family.bidirectional_images
    chosen = {rid: requests[rid] for rid in ("r1", "r2")}
    for rid, pp in chosen.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    results = engine.run_until_done()
    check_against_hf(str(folder), chosen, results)
    assert results["r2"] != hf_generate(model_dir, requests["r2"].prompt_ids, requests["r2"].images, MAX_NEW)


@pytest.mark.parametrize("exact", [True, None], ids=["exact_attention", "padded_default"])
def test_bf16_ragged_batch_matches_hf_bf16(model_dir, requests, exact):
    """bfloat16, the serving default where the hardware has it natively: with exact attention HF bf16's ids
    (each sliding layer over exactly the keys HF's sliding cache holds, the patch embedder given the
    processor's float32 pixels as HF is); padded, HF bf16's up to HF's first top-2 tie (common/exactness.py),
    the vision tower's padding patches masked as HF masks them."""
    from mserve.common.exactness import compare_greedy
    from tests.helpers import hf_generate_top2

    engine = new_engine(model_dir, dtype="bfloat16", exact_attention=exact)
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=greedy())
    out = engine.run_until_done()
    compared = 0
    for rid, pp in requests.items():
        want, top2 = hf_generate_top2(model_dir, pp.prompt_ids, pp.images, MAX_NEW, dtype="bfloat16")
        verdict = compare_greedy(want, out[rid], top2, "bfloat16")
        assert (out[rid] == want) if exact else verdict.exact, f"{rid}: {verdict.describe()}"
        compared += len(want) if exact else verdict.compared  # exact: every step was compared
    # Not vacuous. Where HF's own first top-2 tie falls depends on the host's bf16 kernels: the one-image
    # prompt is compared over 8 steps on an AMX Xeon, over 5 on an AVX2-only EPYC (no native bf16).
    assert compared >= 5


def test_a_generated_image_token_is_read_as_pad_as_hf_reads_it(model_dir, builder):
    """The tiny model generates the image token on this prompt: HF's forward embeds it (every placeholder id) as
    the pad token, so the next tokens depend on the engine doing the same (it embedded the token itself)."""
    from tests.helpers import request_mix

    text, images = request_mix(6, seed=11)[2]
    pp = builder.prepare_text(text, images)
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, 12)
    assert builder.family.image_token_id in expected[:-1]
    engine = new_engine(model_dir)
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=greedy(12))
    assert engine.run_until_done()["r"] == expected
