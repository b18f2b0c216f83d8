"""The bf16 RMSNorm and SiLU * up kernels (workers/fused_ops.py): HF's values to within a bf16 step at
each of its two roundings (on these inputs, the same bits for 99 % of the values or more); the rotary
embedding kernels (bf16 and float32): HF's bits; which modules the engine changes, and only where
attention is padded."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

from mserve.workers import fused_ops, kernels
from mserve.workers.engine import Engine, EngineConfig

fns = kernels.library()
needs_kernel = pytest.mark.skipif(fns is None or "rms_norm_bf16" not in fns,
                                  reason="the bf16 kernels need a C compiler and AVX512_BF16")
needs_library = pytest.mark.skipif(fns is None, reason="the float32 rotary kernel needs a C compiler")


def within_two_roundings(got: torch.Tensor, want: torch.Tensor, min_equal: float) -> None:
    """A bf16 step is 2^-8 to 2^-7 of a value; HF rounds twice (the normalised or activated value, then
    the product), and each may land one step from HF's: 2^-6 relative at most."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2 ** -6)
    assert (got == want).float().mean().item() >= min_equal


@needs_kernel
@pytest.mark.parametrize("width", [512, 72, 3584])
@pytest.mark.parametrize("rows", [1, 16, 527])
def test_rms_norm_is_hf_to_within_two_roundings(width, rows):
    g = torch.Generator().manual_seed(width + rows)
    norm = LlamaRMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=g)
    norm = norm.to(torch.bfloat16)
    fused = fused_ops.FusedRMSNorm(norm, fns["rms_norm_bf16"])
    x = (torch.randn(1, rows, width, generator=g) * 4).bfloat16()
    within_two_roundings(fused(x), norm(x), min_equal=0.99)
    wide = torch.randn(rows, 2 * width, generator=g).bfloat16()[:, ::2]  # rows not contiguous
    within_two_roundings(fused(wide), norm(wide), min_equal=0.99)
    assert fused(x.float()).dtype == torch.float32  # anything but bf16: HF's own ops
    torch.testing.assert_close(fused(x.float()), norm.float()(x.float()))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 527])
def test_mlp_is_hf_to_within_two_roundings(rows):
    torch.manual_seed(rows)
    mlp = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=1376, hidden_act="silu")).bfloat16()
    fused = fused_ops.FusedMLP(mlp, fns["silu_mul_bf16"])
    x = torch.randn(1, rows, 256).bfloat16()
    within_two_roundings(fused(x), mlp(x), min_equal=0.99)


@needs_kernel
def test_silu_mul_at_the_edges():
    """Large, tiny and signed zero gates, where e^-x would overflow: torch's silu(g) * u."""
    gate = torch.tensor([[0.0, -0.0, 1e-3, -1e-3, 5.0, -5.0, 30.0, -30.0, 88.0, -88.0, 100.0, -100.0, 3e4, -3e4,
                          1e-30, -1e-30, 2.5, -2.5]]).bfloat16()
    up = torch.linspace(-3, 3, gate.shape[1]).bfloat16()[None]
    out = torch.empty_like(gate)
    fns["silu_mul_bf16"](gate.data_ptr(), up.data_ptr(), out.data_ptr(), 1, gate.shape[1], gate.shape[1],
                         up.shape[1], out.shape[1])
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out.float(), want.float(), atol=1e-30, rtol=2 ** -6)


@needs_kernel
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "tokens", "dim"),
                         [(1, 8, 4, 673, 64), (2, 4, 2, 5, 80), (1, 2, 1, 1, 128), (3, 8, 4, 17, 64)])
def test_rotary_is_hf_bit_for_bit(batch, heads, kv_heads, tokens, dim):
    """q and k as HF's attention passes them ([B, heads, T, D] views of [B, T, heads, D]), cos and sin of
    large angles (every bf16 rounding exercised), per batch row and one row broadcast over the batch."""
    original = fused_ops._original_function(modeling_llama.apply_rotary_pos_emb)
    rotary = fused_ops.FusedRotary(original, {torch.bfloat16: fns["rope_bf16"]})
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    q = (torch.randn(batch, tokens, heads, dim, generator=gen) * 3).to(torch.bfloat16).transpose(1, 2)
    k = (torch.randn(batch, tokens, kv_heads, dim, generator=gen) * 3).to(torch.bfloat16).transpose(1, 2)
    angles = torch.randn(batch, tokens, dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        want, got = original(q, k, c, s), rotary(q, k, c, s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].stride() == want[0].stride() or tokens == 1  # the layout torch's ops give
    float_q = q.float()  # anything but bf16 goes to HF's function
    assert torch.equal(rotary(float_q, k.float(), cos.float(), sin.float())[0],
                       original(float_q, k.float(), cos.float(), sin.float())[0])


@needs_library
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "tokens", "dim"),
                         [(1, 8, 4, 673, 64), (2, 4, 2, 5, 80), (1, 2, 1, 1, 128), (3, 8, 4, 17, 64)])
def test_float32_rotary_is_hf_bit_for_bit(batch, heads, kv_heads, tokens, dim):
    """The portable float32 kernel: the same three operations an element as torch's, none fused into an
    FMA, so HF's bits on any host; bf16 inputs go to HF's function when only float32 is routed."""
    original = fused_ops._original_function(modeling_llama.apply_rotary_pos_emb)
    rotary = fused_ops.FusedRotary(original, {torch.float32: fns["rope_f32"]})
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    q = (torch.randn(batch, tokens, heads, dim, generator=gen) * 3).transpose(1, 2)
    k = (torch.randn(batch, tokens, kv_heads, dim, generator=gen) * 3).transpose(1, 2)
    angles = torch.randn(batch, tokens, dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        want, got = original(q, k, c, s), rotary(q, k, c, s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].stride() == want[0].stride() or tokens == 1
    half = [t.bfloat16() for t in (q, k, cos, sin)]
    assert torch.equal(rotary(*half)[0], original(*half)[0])


def rotary_fused(module) -> bool:
    funcs = module.__dict__.get("_kernel_funcs") or {}
    return isinstance(funcs.get(fused_ops.ROTARY), fused_ops.FusedRotary)


def fused_counts(model_dir: str, **cfg) -> tuple[int, int, int, int]:
    """An engine's fused RMSNorms, fused MLPs and attention layers with the fused rotary embedding, and
    its language model's layer count."""
    model = Engine(EngineConfig(model_dir, num_blocks=64, block_size=16, **{"dtype": "float32", **cfg})).runner.model
    return (sum(isinstance(m, fused_ops.FusedRMSNorm) for m in model.modules()),
            sum(isinstance(m, fused_ops.FusedMLP) for m in model.modules()),
            sum(rotary_fused(m) for m in model.modules()),
            model.config.text_config.num_hidden_layers)


@needs_kernel
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_what_the_engine_fuses(family, tiny_model_dirs, monkeypatch):
    """Padded bf16: every RMSNorm and SiLU MLP of Llama's form (Gemma's norm and GELU MLP are not), and
    the rotary embedding of every attention layer whose family uses Llama's (Qwen2-VL's multimodal one
    is not); exact attention and MSERVE_FUSED_OPS=off: none (float32: the test below)."""
    fused = functools.partial(fused_counts, str(tiny_model_dirs[family]))
    norms, mlps, rotary, layers = fused(dtype="bfloat16", exact_attention=False)
    if family == "gemma3":
        assert (norms, mlps) == (0, 0)
    else:
        assert norms >= 2 * layers + 1 and mlps >= layers  # two a layer and the final one; one MLP a layer
    assert rotary == (0 if family == "qwen2_vl" else layers)
    assert fused(dtype="bfloat16", exact_attention=True)[:3] == (0, 0, 0)
    monkeypatch.setenv("MSERVE_FUSED_OPS", "off")
    assert fused(dtype="bfloat16", exact_attention=False)[:3] == (0, 0, 0)


@needs_library
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_what_the_engine_fuses_in_float32(family, tiny_model_dirs, monkeypatch):
    """Padded float32 (its default), on any host with a compiler: Llama's rotary embedding, no RMSNorm
    or MLP; exact attention and MSERVE_FUSED_OPS=off: none."""
    fused = functools.partial(fused_counts, str(tiny_model_dirs[family]))
    norms, mlps, rotary, layers = fused(exact_attention=False)
    assert (norms, mlps) == (0, 0)
    assert rotary == (0 if family == "qwen2_vl" else layers)
    assert fused(exact_attention=True)[:3] == (0, 0, 0)
    monkeypatch.setenv("MSERVE_FUSED_OPS", "off")
    assert fused(exact_attention=False)[:3] == (0, 0, 0)
