"""The prompt kernel that reads the paged pool in place in bfloat16 (workers/paged_prefill.py): float32
attention over the pool's bf16 values to within bf16 rounding, and the engine's prompt attention with
it is the gather + SDPA it replaces, to within the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mserve.workers import kernels, paged_attention, paged_prefill
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.paged_attention import _gather
from mserve.workers.sequence import SamplingParams
from tests.helpers import request_mix

needs_kernel = pytest.mark.skipif(not kernels.library() or "prefill_bf16" not in kernels.library(),
                                  reason="the prompt kernel is built only where the CPU has AVX512_BF16")


needs_tiles = pytest.mark.skipif(not paged_prefill._kernel_amx(),
                                 reason="the kernel multiplies on AMX tiles only where its build and the CPU have them")


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """These tests check the kernel itself, so it runs on every host and head size, AMX ones included
    (where `auto` may leave prompt attention to SDPA: test_amx_hosts_use_the_kernel_only_on_tiles)."""
    monkeypatch.setenv("MSERVE_PROMPT_KERNEL", "on")
    paged_prefill.policy.cache_clear()
    yield
    paged_prefill.policy.cache_clear()


@pytest.fixture(params=["tiles", "vdpbf16ps"])
def products(request):
    """Each product path of the kernel: AMX tiles where they run here, and vdpbf16ps everywhere."""
    fns = kernels.library()
    if request.param == "tiles" and not paged_prefill._kernel_amx():
        pytest.skip("no AMX tiles in this host's kernel build")
    if fns and "prefill_use_amx" in fns:
        fns["prefill_use_amx"](int(request.param == "tiles"))
    yield request.param
    if fns and "prefill_use_amx" in fns:
        fns["prefill_use_amx"](1)


@pytest.mark.parametrize("choice,amx,tiles,want,multiple", [
    ("auto", True, False, False, 16),  # torch's SDPA on AMX beats the vdpbf16ps products
    ("auto", True, True, True, 32),  # the kernel on tiles beats SDPA, for head sizes that fill a tile row
    ("auto", False, False, True, 16), ("on", True, False, True, 16), ("off", False, False, False, 16),
    ("0", False, True, False, 16), ("True", True, True, True, 16)])
def test_amx_hosts_use_the_kernel_only_on_tiles(choice, amx, tiles, want, multiple, monkeypatch):
    monkeypatch.setenv("MSERVE_PROMPT_KERNEL", choice)
    monkeypatch.setattr(paged_prefill, "_amx", lambda: amx)
    monkeypatch.setattr(paged_prefill, "_kernel_amx", lambda: tiles)
    paged_prefill.policy.cache_clear()
    assert paged_prefill.policy() == (want, multiple) and paged_prefill.preferred() is want
    if kernels.library() and "prefill_bf16" in kernels.library():
        k16, k32 = (torch.zeros(8, 16, 2, d, dtype=torch.bfloat16) for d in (16, 32))
        assert paged_prefill.usable(torch.zeros(4, 9, 32, dtype=torch.bfloat16), k32) is want
        assert paged_prefill.usable(torch.zeros(4, 9, 16, dtype=torch.bfloat16), k16) is (want and multiple == 16)


def test_a_prompt_kernel_setting_it_does_not_know_is_an_error(monkeypatch):
    monkeypatch.setenv("MSERVE_PROMPT_KERNEL", "sometimes")
    paged_prefill.policy.cache_clear()
    with pytest.raises(ValueError, match="MSERVE_PROMPT_KERNEL must be auto, on or off"):
        paged_prefill.preferred()


def causal_reference(q, k_cache, v_cache, tables, starts, scale):
    """Float32 attention over the same bf16 values: chunk g's token i sees keys 0 .. starts[g] + i."""
    n = q.shape[1]
    k, v = _gather(k_cache.float(), tables), _gather(v_cache.float(), tables)
    pos = starts[:, None] + torch.arange(n)[None]
    mask = (torch.arange(k.shape[2])[None, None] <= pos[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,n,starts", [
    (8, 4, 64, 37, [0, 5, 100]),  # GQA, chunks starting inside a block, past one, at 0
    (8, 4, 64, 512, [0]),  # a whole first chunk, 32 query tiles
    (4, 4, 32, 1, [0, 16, 300]),  # one token each, no GQA
    (12, 2, 128, 17, [3, 31]),  # 6 query heads a kv head, two passes over the head's dims
    (4, 2, 48, 20, [0, 33]),  # a head size of three 16-lane chunks
    (4, 2, 96, 20, [0, 33]),  # on tiles: 64 dims, then the last 32
    (4, 2, 16, 9, [0, 7]),  # the tiny test models' head size
])
def test_kernel_is_float32_attention_to_within_bf16(heads, kv_heads, head_dim, n, starts, products):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + n)
    bs, num_blocks = 16, 200
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).bfloat16()
    starts = torch.tensor(starts)
    max_blocks = -(-(int(starts.max()) + n) // bs)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in starts]).contiguous()
    q = (torch.randn(len(starts), n, heads, head_dim, generator=g) * 2).bfloat16()  # peaked softmax rows
    out = paged_prefill.attend(q, k_cache, v_cache, tables, starts, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    want = causal_reference(q, k_cache, v_cache, tables, starts, head_dim ** -0.5)
    # the output's own rounding (half a bf16 ulp) and the probabilities' before P @ V
    torch.testing.assert_close(out.float(), want, atol=1.2e-2, rtol=2 ** -7)


@needs_kernel
def test_what_the_kernel_refuses():
    k = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(4, 3, 64, dtype=torch.bfloat16)  # [heads, rows, head_dim], as _attend holds it
    assert paged_prefill.usable(q, k)
    assert not paged_prefill.usable(q.float(), k.float())  # float32 keeps SDPA
    assert not paged_prefill.usable(q[..., :40], k[..., :40])  # a head size off the 16-lane grid
    with pytest.raises(ValueError, match="do not fit"):  # a chunk past its request's blocks
        paged_prefill.attend(torch.zeros(1, 20, 4, 64, dtype=torch.bfloat16), k, k,
                             torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), 1.0)


@needs_kernel
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_engine_prompt_attention_with_the_kernel_is_the_gathers(family, tiny_model_dirs, monkeypatch):
    """bf16 with `--attention padded`, a ragged batch of text and image prompts in 24-token chunks (first
    chunks, later chunks, decode tokens beside them): every prompt group's attention output with the
    kernel is the gather + SDPA output for the same inputs, to within bf16 rounding. (The tiny models'
    head size, 16, runs the vdpbf16ps products everywhere.)"""
    engine_prompts_match_the_gathers(str(tiny_model_dirs[family]), monkeypatch, chunk=24)


@pytest.fixture(scope="module")
def small_llava(tmp_path_factory):
    """The `small` llava: head size 64, so its prompt attention runs on AMX tiles where they are."""
    from mserve.common.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("small") / "llava", "llava", "small", seed=0)


@needs_kernel
@needs_tiles
def test_engine_prompt_attention_on_tiles_is_the_gathers(small_llava, monkeypatch):
    """The same in an engine whose prompt kernel multiplies on AMX tiles (the `small` llava, 64-token
    chunks: images of hundreds of tokens in several chunks)."""
    engine_prompts_match_the_gathers(str(small_llava), monkeypatch, chunk=64)


def engine_prompts_match_the_gathers(model_dir: str, monkeypatch, chunk: int) -> None:
    from mserve.common.prompt import PromptBuilder

    builder = PromptBuilder(model_dir)
    requests = {f"r{i}": builder.prepare_text(text, images) for i, (text, images) in enumerate(request_mix(6, seed=3))}
    compared = []
    attend, usable = paged_attention._attend, paged_prefill.usable

    def both(group, query, k_cache, v_cache, scaling, window=None, chunk=None):
        out = attend(group, query, k_cache, v_cache, scaling, window, chunk)
        if group.decode_lens is None and usable(query, k_cache):
            monkeypatch.setattr(paged_prefill, "usable", lambda *a: False)
            try:
                want = attend(group, query, k_cache, v_cache, scaling, window, chunk)
            finally:
                monkeypatch.setattr(paged_prefill, "usable", usable)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2 ** -6)
            compared.append(group.query_index.shape)
        return out

    monkeypatch.setattr(paged_attention, "_attend", both)
    engine = Engine(EngineConfig(model_dir, dtype="bfloat16", exact_attention=False, num_blocks=512, block_size=16,
                                 max_prefill_tokens=chunk))
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=4))
    results = engine.run_until_done()
    assert sorted(results) == sorted(requests) and all(len(ids) == 4 for ids in results.values())
    layers = engine.runner.model.config.text_config.num_hidden_layers
    assert len(compared) >= layers * len(requests) * 2  # every prompt went in two chunks or more


@needs_kernel
@needs_tiles
def test_tiles_and_vdpbf16ps_differ_only_in_rounding():
    """The same inputs through both product paths: the scores and outputs summed in another order, so
    the bf16 probabilities may round the other way for a few keys, never more."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(64, 16, 2, 64, generator=g).bfloat16() for _ in range(2))
    tables = torch.randperm(64, generator=g)[:44].view(1, 44).contiguous()
    q, starts = torch.randn(1, 161, 8, 64, generator=g).bfloat16(), torch.tensor([512])
    fns = kernels.library()
    try:
        outs = []
        for tiles in (1, 0):
            fns["prefill_use_amx"](tiles)
            outs.append(paged_prefill.attend(q, k_cache, v_cache, tables, starts, 0.125).float())
    finally:
        fns["prefill_use_amx"](1)
    assert not torch.equal(outs[0], outs[1])  # two paths ran
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2 ** -7)


@needs_kernel
def test_vision_attention_is_sdpa_to_within_bf16():
    """Every patch attends to every patch: the kernel with its causal mask off, image b's keys as pool
    block b, against float32 SDPA over the same values; a mask or a causal module keeps SDPA."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(3, 4, 577, 32, generator=g).bfloat16() for _ in range(3))
    module = torch.nn.Module()
    out, _ = paged_prefill.vision_attention_forward(module, q, k, v, None, scaling=0.2)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.2).transpose(1, 2)
    assert out.shape == (3, 577, 4, 32)
    torch.testing.assert_close(out.float(), want, atol=1.2e-2, rtol=2 ** -7)
    mask = torch.zeros(3, 1, 577, 577, dtype=torch.bfloat16)
    mask[..., 300:] = float("-inf")  # a mask the kernel does not take: SDPA's answer, masked
    masked, _ = paged_prefill.vision_attention_forward(module, q, k, v, mask, scaling=0.2)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=0.2)
    torch.testing.assert_close(masked.float(), want.transpose(1, 2), atol=1.2e-2, rtol=2 ** -7)


@needs_kernel
def test_only_padded_bf16_routes_the_vision_tower(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llava"])
    from mserve.common.images import decode_image
    from tests.helpers import make_image

    impl = {}
    for name, cfg in {"padded": dict(dtype="bfloat16", exact_attention=False), "exact": dict(dtype="bfloat16", exact_attention=True),
                      "float32": dict(dtype="float32", exact_attention=False)}.items():
        engine = Engine(EngineConfig(model_dir, num_blocks=64, block_size=16, **cfg))
        impl[name] = engine.runner.model.config.vision_config._attn_implementation
    assert impl == {"padded": paged_prefill.VISION_ATTN_IMPLEMENTATION, "exact": "sdpa", "float32": "sdpa"}
    engine = Engine(EngineConfig(model_dir, dtype="bfloat16", exact_attention=False, num_blocks=64, block_size=16))
    images = [decode_image(make_image(120, 90, seed=1)), decode_image(make_image(64, 200, seed=2))]
    runner = engine.runner
    got = [e.embeds.float() for e in runner.encode_visuals(images)]
    runner.model.config.vision_config._attn_implementation = "sdpa"
    sdpa = [e.embeds.float() for e in runner.encode_visuals(images)]
    reference = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=64, block_size=16))  # float32: what both approximate
    want = [e.embeds for e in reference.runner.encode_visuals(images)]
    for k, s_, w in zip(got, sdpa, want):  # the kernel's bf16 error is SDPA's bf16 error, give or take
        assert k.shape == w.shape
        assert (k - w).abs().mean() <= 1.2 * (s_ - w).abs().mean()
        assert (k - w).abs().max() <= 1.5 * (s_ - w).abs().max()
