"""bf16 linear layers over weights packed once (workers/packed_linear.py): F.linear's very bits without
a bias, and used by the engine in bf16 on the CPU only (tests/workers/test_engine_bf16.py then checks
HF's tokens with them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mserve.workers import packed_linear
from mserve.workers.engine import Engine, EngineConfig

needs_packing = pytest.mark.skipif(not packed_linear.available(), reason="no prepacked mkldnn linear in this torch")


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
    for rows in ROWS:
        x = torch.randn(*rows, n_in).bfloat16()
        torch.testing.assert_close(packed(x).float(), layer(x).float(), atol=1e-2, rtol=2 ** -8)


@needs_packing
def test_the_engine_packs_bf16_cpu_models_only(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llava"])

    def count(**cfg):
        model = Engine(EngineConfig(model_dir, num_blocks=64, block_size=16, **cfg)).runner.model
        return sum(isinstance(m, packed_linear.PackedLinear) for m in model.modules()), \
            sum(type(m) is nn.Linear for m in model.modules())

    packed, plain = count(dtype="bfloat16", exact_attention=False)
    assert packed > 0 and plain == 0  # language model, vision tower and projector alike
    packed, plain = count(dtype="bfloat16")  # exact attention: the layers without a bias only
    assert packed > 0 and plain > 0
    assert count()[0] == 0  # float32 keeps F.linear (its CPU path is not oneDNN's)
