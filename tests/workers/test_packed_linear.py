"""Linear layers over weights packed once (workers/packed_linear.py): in bf16 without a bias, F.linear's
very bits; otherwise within rounding. The engine and cluster tests check HF's tokens with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mserve.workers import packed_linear
from mserve.workers.engine import Engine, EngineConfig

# Asked per dtype: an AVX2-only CPU packs float32 but not bfloat16 (oneDNN wants AVX-512 for that).
needs_packing = pytest.mark.skipif(not packed_linear.available(torch.bfloat16),
                                   reason="no prepacked bf16 mkldnn linear in this torch on this CPU")
needs_f32_packing = pytest.mark.skipif(not packed_linear.available(torch.float32),
                                       reason="no prepacked float32 mkldnn linear in this torch")


SHAPES = [(96, 200), (512, 1376), (512, 4000)]  # (in, out): a small layer, the peer's MLP and LM head
ROWS = [(1,), (2,), (16,), (37,), (512,), (2, 7)]


@needs_packing
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_without_a_bias_packed_is_f_linear_bit_for_bit(n_in, n_out):
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out, bias=False).bfloat16()
    packed = packed_linear.PackedLinear(layer)
    for rows in ROWS:
        x = torch.randn(*rows, n_in).bfloat16()
        assert torch.equal(packed(x), layer(x)), rows


@needs_packing
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_with_a_bias_packed_is_f_linear_to_within_one_rounding(n_in, n_out):
    """Why biased layers are packed only under padded attention: not always F.linear's bits."""
    torch.manual_seed(1)
    layer = nn.Linear(n_in, n_out).bfloat16()
    packed = packed_linear.PackedLinear(layer)
    # Out of autograd (grad mode is on here): a bias that requires grad took the op through autograd's
    # fallback, 600 ms a call at 16 rows of 512 -> 1376 instead of 0.13.
    assert not packed.bias.requires_grad and packed.bias.data_ptr() == layer.bias.data_ptr()
    for rows in ROWS:
        x = torch.randn(*rows, n_in).bfloat16()
        torch.testing.assert_close(packed(x).float(), layer(x).float(), atol=1e-2, rtol=2 ** -8)


@needs_f32_packing
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_float32_packed_is_f_linear_to_within_its_summation_order(n_in, n_out):
    torch.manual_seed(2)
    layer = nn.Linear(n_in, n_out)
    packed = packed_linear.PackedLinear(layer)
    for rows in ROWS:
        x = torch.randn(*rows, n_in)
        torch.testing.assert_close(packed(x), layer(x), atol=1e-4, rtol=1e-5)


def _counter(tiny_model_dirs, sizes):
    model_dir = str(tiny_model_dirs["llava"])

    def count(**cfg):
        runner = Engine(EngineConfig(model_dir, num_blocks=64, block_size=16, **{"dtype": "float32", **cfg})).runner
        sizes.append(runner.weight_bytes() / runner.dtype.itemsize)  # weights, packed or not, in values
        return sum(isinstance(m, packed_linear.PackedLinear) for m in runner.model.modules()), \
            sum(type(m) is nn.Linear for m in runner.model.modules())
    return count


@needs_packing
def test_what_the_engine_packs_in_bfloat16(tiny_model_dirs, monkeypatch):
    sizes = []
    count = _counter(tiny_model_dirs, sizes)
    packed, plain = count(dtype="bfloat16", exact_attention=False)
    assert packed > 0 and plain == 0  # language model, vision tower and projector alike
    packed, plain = count(dtype="bfloat16", exact_attention=True)  # exact attention: the layers without a bias only
    assert packed > 0 and plain > 0
    monkeypatch.setenv("MSERVE_PACKED_LINEAR", "off")
    assert count(dtype="bfloat16", exact_attention=False)[0] == 0
    assert len(set(sizes)) == 1  # the weights a worker reports (weights_mib) count packed layers too


@needs_f32_packing
def test_what_the_engine_packs_in_float32(tiny_model_dirs, monkeypatch):
    """Float32 packing does not hang on bfloat16's: on a CPU that cannot pack bfloat16 (AVX2 only),
    float32 layers are still packed (they were not, once: one probe in bfloat16 decided both)."""
    sizes = []
    count = _counter(tiny_model_dirs, sizes)
    packed, plain = count()  # float32, padded (its default): every layer
    assert packed > 0 and plain == 0
    assert count(exact_attention=True)[0] == 0  # float32 with exact attention: F.linear's bits
    monkeypatch.setenv("MSERVE_PACKED_LINEAR", "off")
    assert count()[0] == 0
    assert len(set(sizes)) == 1


def test_the_switch_turns_packing_off_in_every_dtype(monkeypatch):
    monkeypatch.setenv("MSERVE_PACKED_LINEAR", "off")
    assert not packed_linear.available(torch.bfloat16) and not packed_linear.available(torch.float32)
    assert not packed_linear.available(torch.float16)  # never packed: F.linear runs
