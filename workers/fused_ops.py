"""RMSNorm and SiLU(gate) * up in one pass each, for a bfloat16 model on the CPU (csrc/fused_ops.c).

Between its matrix multiplies a bf16 language model runs two RMSNorms a layer and the MLP's
SiLU(gate) * up. HF writes each as several torch ops over float32 copies: at a 527-row prefill step
of the peer's `small` llava, 198-277 us an RMSNorm and 560-582 us a SiLU * up on the AMD EPYC host
(the kernels: 71 and 373), about 8 % of a serving worker's loop with the rotary embedding (py-spy;
bench/README.md, "bf16 on the CPU"). The kernels do each in one pass, rounding to bf16 where HF's ops
round; the sum of squares runs in another order and exp and rsqrt differ in their last bits, so each
of the two roundings may land one bf16 step from HF's: the same bits for 99 % of the values or more in
the tests, not HF's bits. Like the prompt kernel, they are used only where attention is padded
(`--attention padded`), which does not promise HF's bits; exact attention keeps HF's modules.

Which modules: those whose forward is HF Llama's RMSNorm or Llama's MLP, word for word (Llama,
Mistral, Qwen2, Qwen3-VL's text model, ... share them), the MLP's activation being SiLU. A family whose
norm differs (Gemma's 1 + weight) or whose MLP has another activation is left as it is. Not with
`--compile` (dynamo cannot trace a ctypes call); `MSERVE_FUSED_OPS=off` keeps HF's modules.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from mserve.workers import kernels

log = logging.getLogger(__name__)

MAX_WIDTH = 8192  # the norm kernel's row buffer
_NORM_SOURCE = inspect.getsource(LlamaRMSNorm.forward)
_MLP_SOURCE = inspect.getsource(LlamaMLP.forward)


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return None


def _same_forward(module: nn.Module, source: str) -> bool:
    return _forward_source(type(module)) == source


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the last dim (a view where it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


class FusedRMSNorm(nn.Module):
    """HF's RMSNorm (Llama's formula) in one pass for bf16 inputs; HF's ops for anything else."""

    def __init__(self, norm: nn.Module, fn) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._fn = fn
        # float32, exactly the bf16 weight's values: the kernel reads it widened once, not every call
        self.register_buffer("weight_f32", norm.weight.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] > MAX_WIDTH:
            return LlamaRMSNorm.forward(self, x)
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=torch.bfloat16)
        rc = self._fn(rows.data_ptr(), self.weight_f32.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
                      rows.stride(0), out.stride(0), float(self.variance_epsilon))
        if rc != 0:  # MAX_WIDTH keeps rows within the kernel's buffer
            raise ValueError(f"fused RMSNorm: the kernel refused rows of {rows.shape[1]}")
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


class FusedMLP(nn.Module):
    """HF's gated MLP with SiLU: down(silu(gate(x)) * up(x)), the middle in one pass for bf16."""

    def __init__(self, mlp: nn.Module, fn) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self._fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.device.type != "cpu":
            return self.down_proj(self.act_fn(gate) * up)
        g, u = _rows(gate), _rows(up)
        out = torch.empty(g.shape, dtype=torch.bfloat16)
        self._fn(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.shape[0], g.shape[1], g.stride(0), u.stride(0),
                 out.stride(0))
        return self.down_proj(out.view(gate.shape))


def _silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse(model: nn.Module) -> int:
    """Swap every RMSNorm and SiLU MLP of Llama's form in `model` (bf16, CPU) for its fused version;
    returns how many were swapped (0 where the kernels are not built or `MSERVE_FUSED_OPS=off`)."""
    if kernels.switched_off("MSERVE_FUSED_OPS"):
        return 0
    fns = kernels.library()
    if fns is None or "rms_norm_bf16" not in fns:
        return 0
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _same_forward(child, _NORM_SOURCE) and child.weight.dtype == torch.bfloat16:
                swaps.append((parent, name, FusedRMSNorm(child, fns["rms_norm_bf16"])))
            elif _same_forward(child, _MLP_SOURCE) and _silu(child.act_fn):
                swaps.append((parent, name, FusedMLP(child, fns["silu_mul_bf16"])))
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    if swaps:
        log.info("bf16 RMSNorm and SiLU * up in one pass each: %d modules", len(swaps))
    return len(swaps)
