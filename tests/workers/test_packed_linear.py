"""bf16 linear layers over weights packed once (workers/packed_linear.py): F.linear's very bits, and
used by the engine in bf16 on the CPU only (tests/workers/test_engine_bf16.py then checks HF's tokens
with them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mserve.workers import packed_linear
from mserve.workers.engine import Engine, EngineConfig

needs_packing = pytest.mark.skipif(not packed_linear.available(), reason="no prepacked mkldnn linear in this torch")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
def test_packed_is_f_linear_bit_for_bit(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias).bfloat16()
    packed = packed_linear.PackedLinear(layer)
    for shape in [(1, 96), (5, 96), (16, 96), (300, 96), (2, 7, 96)]:
        x = torch.randn(shape).bfloat16()
        assert torch.equal(packed(x), layer(x)), shape


@needs_packing
def test_the_engine_packs_bf16_cpu_models_only(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llava"])

    def count(**cfg):
        model = Engine(EngineConfig(model_dir, num_blocks=64, block_size=16, **cfg)).runner.model
        return sum(isinstance(m, packed_linear.PackedLinear) for m in model.modules()), \
            sum(type(m) is nn.Linear for m in model.modules())

    packed, plain = count(dtype="bfloat16")
    assert packed > 0 and plain == 0  # language model, vision tower and projector alike
    assert count()[0] == 0  # float32 keeps F.linear (its CPU path is not oneDNN's)
