"""Linear layers whose weights are reordered once for oneDNN, not on every call (CPU).

bfloat16: torch's `F.linear` runs oneDNN's matmul, which first reorders the weight into its blocked
layout on every call. A decode step's matrix multiplies are small (one row per request) and that
reorder is a large share of them: on an AMD EPYC host, a 1376x512 layer takes 0.090 ms at 16 rows
through `F.linear` and 0.062 prepacked, 0.076 against 0.038 at one row (bench/README.md, "bf16 on the
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

import logging

import torch
from torch import nn

from mserve.workers import kernels

log = logging.getLogger(__name__)

ROWS_HINT = 16  # the batch size oneDNN picks the layout for; any row count runs (same bits)


class PackedLinear(nn.Module):
    """An nn.Linear's forward over a prepacked bf16 weight (mkldnn's `_linear_pointwise`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT),
                             persistent=False)
        # Without grad: a bias that requires grad sends the mkldnn op through autograd's fallback,
        # 500-5,000x slower outside inference_mode (512 -> 1376 at 16 rows: 600 ms against 0.13).
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def available() -> bool:
    """Whether this torch build has the prepacked bf16 linear (mkldnn on the CPU), tried once on a tiny layer."""
    if kernels.switched_off("MSERVE_PACKED_LINEAR"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = nn.Linear(32, 8, bias=False, dtype=torch.bfloat16)
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        return torch.equal(PackedLinear(layer)(x), layer(x))
    except (RuntimeError, AttributeError) as exc:
        log.info("bf16 linear layers unpacked: this torch has no prepacked mkldnn linear (%s)", exc)
        return False


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
    if not available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packable(child, exact):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
