"""bfloat16 linear layers whose weights are reordered once, not on every call (CPU).

torch's bf16 `F.linear` on the CPU runs oneDNN's matmul, which first reorders the weight into its
blocked layout, on every call. A decode step's matrix multiplies are small (one row per request) and
that reorder is a large share of them: on an AMD EPYC host, a 1376x512 layer takes 86 us at 16 rows
through `F.linear` and 61 us prepacked, 53 against 28 at one row, and 1,464 against 1,400 at 512
(bench/README.md, "bf16 on the CPU"). Without a bias the packed call is the same oneDNN kernel over
the same values: its outputs are `F.linear`'s bits, so exact-length attention still gives HF
generate's tokens (tests/workers/test_packed_linear.py). With a bias it rounds differently from
`F.linear` at some shapes (one bf16 ulp), so layers with a bias (Qwen2's q/k/v, a CLIP vision tower)
are packed only where attention is padded, which does not promise HF's bits anyway.

Used by ModelRunner for bf16 models on the CPU (not with `--compile`). The original weight tensors
are released unless something else holds them (a tied embedding keeps its own).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

ROWS_HINT = 16  # the batch size oneDNN picks the layout for; any row count runs (same bits)


class PackedLinear(nn.Module):
    """An nn.Linear's forward over a prepacked bf16 weight (mkldnn's `_linear_pointwise`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def available() -> bool:
    """Whether this torch build has the prepacked bf16 linear (mkldnn on the CPU), tried once on a tiny layer."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = nn.Linear(32, 8, bias=False, dtype=torch.bfloat16)
        x = torch.ones(2, 32, dtype=torch.bfloat16)
        return torch.equal(PackedLinear(layer)(x), layer(x))
    except (RuntimeError, AttributeError) as exc:
        log.info("bf16 linear layers unpacked: this torch has no prepacked mkldnn linear (%s)", exc)
        return False


def pack_linears(model: nn.Module, with_bias: bool) -> int:
    """Swap every bf16 CPU nn.Linear in `model` for a PackedLinear (those with a bias only if `with_bias`:
    their bits differ from F.linear's); returns how many were swapped."""
    if not available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu" and (with_bias or child.bias is None)):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
