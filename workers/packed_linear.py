"""Linear layers whose weights are reordered once for oneDNN, not on every call (CPU).

bfloat16: torch's `F.linear` runs oneDNN's matmul, which first reorders the weight into its blocked
layout on every call. A decode step's matrix multiplies are small (one row per request) and that
reorder is a large share of them: on an AMD EPYC host, a 1376x512 layer takes 0.090 ms at 16 rows
through `F.linear` and 0.062 prepacked, 0.076 against 0.038 at one row (bench/lab/NOTEBOOK.md, "bf16 on the
CPU"). Without a bias the packed call is the same oneDNN kernel over the same values: `F.linear`'s
bits, so exact-length attention still gives HF generate's tokens (tests/workers/test_packed_linear.py).
With a bias it rounds differently at some shapes (one bf16 ulp), so biased layers (Qwen2's q/k/v, a
CLIP vision tower) are packed only where attention is padded, which does not promise HF's bits.

float32: torch's `F.linear` runs MKL's sgemm, which on that host reaches about 110 GFLOP/s; oneDNN's
prepacked float32 matmul 2.3-2.5x that at 16 and 512 rows. Its sums run in another order (outputs
within about 5e-6 relative), like the decode kernel's: every engine and cluster test still gives HF
generate's tokens with it, on every family. Packed unless attention is exact (`--attention exact`,
which promises HF's bits).

Used by ModelRunner on the CPU (not with `--compile`); `MSERVE_PACKED_LINEAR=off` keeps `F.linear`.
The original weight tensors are released unless something else holds them (a tied embedding keeps
its own).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from mserve.workers import kernels

log = logging.getLogger(__name__)

ROWS_HINT = 16  # the batch size oneDNN picks the layout for; any row count runs (same bits)


class PackedLinear(nn.Module):
    """An nn.Linear's forward over a prepacked bfloat16 or float32 weight (mkldnn's `_linear_pointwise`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT),
                             persistent=False)
        # Without grad: a bias that requires grad sends the mkldnn op through autograd's fallback,
        # 500-5,000x slower outside inference_mode (512 -> 1376 at 16 rows: 600 ms against 0.13).
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in with the released weight's shape and dtype only: model code reads a linear's
        weight.dtype (Gemma 4's patch embedder casts its pixels to it). On the meta device it holds no
        memory, and math with it fails loudly rather than silently."""
        return torch.empty((self.out_features, self.in_features), dtype=self.packed.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether linear layers in `dtype` can be packed: not switched off (MSERVE_PACKED_LINEAR=off), and
    this torch on this CPU has the prepacked mkldnn linear in that dtype (`_works`).

    Asked per dtype: oneDNN packs bfloat16 only where the CPU has AVX512BW/VL/DQ or AVX-NE-CONVERT,
    float32 on any x86 CPU (an AVX2-only AMD EPYC refuses the one and runs the other 10-40 % faster
    than F.linear at 16 rows: bench/lab/NOTEBOOK.md, "An AVX2 host")."""
    return not kernels.switched_off("MSERVE_PACKED_LINEAR") and _works(dtype)


@functools.cache
def _works(dtype: torch.dtype) -> bool:
    """Tried once a process on a tiny layer: in bfloat16 the packed linear must give F.linear's bits; in
    float32, its values within rounding."""
    name = str(dtype).removeprefix("torch.")
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        layer = nn.Linear(32, 8, bias=False, dtype=dtype)
        x = torch.linspace(-1, 1, 64, dtype=dtype).view(2, 32)
        got, want = PackedLinear(layer)(x), layer(x)
    except (RuntimeError, AttributeError) as exc:
        log.info("%s linear layers unpacked: no prepacked mkldnn linear in it here (%s)", name, exc)
        return False
    same = torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if not same:
        log.info("%s linear layers unpacked: the prepacked mkldnn linear disagreed with F.linear", name)
    return same


def packable(linear: nn.Module, exact: bool) -> bool:
    """Whether ModelRunner packs this layer: a CPU nn.Linear in bfloat16 (one with a bias only when
    attention is padded) or in float32 (only when attention is padded)."""
    if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
        return False
    if linear.weight.dtype == torch.bfloat16:
        return not exact or linear.bias is None
    return linear.weight.dtype == torch.float32 and not exact


def pack_linears(model: nn.Module, exact: bool) -> int:
    """Swap every packable nn.Linear in `model` for a PackedLinear; returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packable(child, exact) and available(child.weight.dtype):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
