"""RMSNorm, SiLU(gate) * up and the rotary embedding in one pass each, for a bfloat16 model on the CPU
(csrc/fused_ops.c); for a float32 model, the rotary embedding.

Between its matrix multiplies a bf16 language model runs two RMSNorms a layer and the MLP's
SiLU(gate) * up. HF writes each as several torch ops over float32 copies: at a 527-row prefill step
of the peer's `small` llava, 198-277 us an RMSNorm and 560-582 us a SiLU * up on the AMD EPYC host
(the kernels: 71 and 373), about 8 % of a serving worker's loop with the rotary embedding (py-spy;
bench/lab/NOTEBOOK.md, "bf16 on the CPU"). The kernels do each in one pass, rounding to bf16 where HF's ops
round; the sum of squares runs in another order and exp and rsqrt differ in their last bits, so each
of the two roundings may land one bf16 step from HF's: the same bits for 99 % of the values or more in
the tests, not HF's bits. Like the prompt kernel, they are used only where attention is padded
(`--attention padded`), which does not promise HF's bits; exact attention keeps HF's modules.

Which modules: those whose forward is HF Llama's RMSNorm or Llama's MLP, word for word (Llama,
Mistral, Qwen2, Qwen3-VL's text model, ... share them), the MLP's activation being SiLU. A family whose
norm differs (Gemma's 1 + weight) or whose MLP has another activation is left as it is. Not with
`--compile` (dynamo cannot trace a ctypes call); `MSERVE_FUSED_OPS=off` keeps HF's modules.

The rotary embedding: HF's `apply_rotary_pos_emb` (q * cos + rotate_half(q) * sin, and the same for k)
is five bf16 torch ops a tensor, 8 ms of a 228 ms image request on an Intel AMX host (py-spy;
bench/lab/NOTEBOOK.md, "Where vLLM-CPU's model core goes"). Its products of two bf16 values are exact in
float32, so the kernel's three roundings give HF's bits. Each attention module decorated with
transformers' `use_kernelized_func(apply_rotary_pos_emb)` routes that call to its own wrapper in
`module._kernel_funcs` (the `kernels` package's hook): the fused one replaces that wrapper in this
model's modules only, where the family's function is Llama's word for word (Qwen2-VL's multimodal
rotary is not). In float32 a portable C kernel does the same three operations an element as torch,
none contracted into an FMA: HF's bits, on any host with a compiler (a 673-token prompt's q and k 3.6
-> 0.9 ms on an AVX2-only AMD EPYC), under padded attention like the rest.
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
ROTARY = "rotary_pos_emb"  # the key of `_kernel_funcs`: the hub layer name transformers gives the function


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


def _original_function(hub_func: object) -> object | None:
    """The plain function a transformers `use_kernel_forward_from_hub` wrapper falls back to (held in its
    forward's closure), or None where the wrapper is built otherwise."""
    for cell in getattr(type(hub_func).forward, "__closure__", None) or ():
        if inspect.isfunction(cell.cell_contents):
            return cell.cell_contents
    return None


@functools.lru_cache(maxsize=1)
def _rotary_source() -> str | None:
    from transformers.models.llama import modeling_llama

    fn = _original_function(modeling_llama.apply_rotary_pos_emb)
    return inspect.getsource(fn) if fn is not None else None


class FusedRotary(nn.Module):
    """HF's apply_rotary_pos_emb for bf16 or float32 [B, heads, T, head_dim] q and k in one pass each;
    HF's function for anything else."""

    def __init__(self, original, fns: dict) -> None:
        super().__init__()
        self._original, self._fns = original, fns  # the kernel by dtype

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)  # x's layout, as torch's elementwise ops would give it
        b = cos.stride(0) if cos.shape[0] == x.shape[0] else 0  # one batch row broadcast over x's
        self._fns[x.dtype](x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                 x.shape[3], x.stride(0), x.stride(1), x.stride(2), b, cos.stride(1), out.stride(0), out.stride(1),
                 out.stride(2))
        return out

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        usable = (unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and cos.dim() == 3
                  and q.dtype in self._fns
                  and all(t.dtype == q.dtype and t.device.type == "cpu" for t in (q, k, cos, sin))
                  and q.shape[-1] % 2 == 0 and q.shape[-1] == k.shape[-1] == cos.shape[-1]
                  and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] in (1, q.shape[0])
                  and cos.stride() == sin.stride() and cos.stride(-1) == 1
                  and q.stride(-1) == 1 and k.stride(-1) == 1)
        if not usable:
            return self._original(q, k, cos, sin, unsqueeze_dim)
        return self._rope(q, cos, sin), self._rope(k, cos, sin)


def _fuse_rotary(module: nn.Module, fns: dict) -> bool:
    """Route this attention module's apply_rotary_pos_emb to the kernel, where it is Llama's."""
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict) or ROTARY not in funcs or isinstance(funcs[ROTARY], FusedRotary):
        return False
    original = _original_function(funcs[ROTARY])
    if original is None or _rotary_source() is None or _source(original) != _rotary_source():
        return False
    funcs[ROTARY] = FusedRotary(original, fns)
    return True


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse(model: nn.Module, dtype: torch.dtype) -> int:
    """Fuse the elementwise ops of a `dtype` model on the CPU; returns how many modules were changed (0
    where the kernels are not built or `MSERVE_FUSED_OPS=off`).

    bfloat16 (where the CPU has AVX512_BF16): every RMSNorm and SiLU MLP of Llama's form is swapped for
    its one-pass version, and Llama's rotary embedding routed to the kernel. float32 (any host with a
    compiler): the rotary embedding only, in one pass with HF's bits (a 673-token prompt's q and k: 3.6
    ms -> 0.9 on an AVX2 host, bench/lab/NOTEBOOK.md, "An AVX2 host")."""
    if kernels.switched_off("MSERVE_FUSED_OPS"):
        return 0
    fns = kernels.library()
    if fns is None:
        return 0
    if dtype == torch.float32:
        # SiLU * up in place over gate's tensor was 4 % quicker than HF's at 700 rows: not kept
        rope, mlps, norms = ({torch.float32: fns["rope_f32"]} if "rope_f32" in fns else {}), [], []
    elif dtype == torch.bfloat16 and "rms_norm_bf16" in fns:
        rope = {torch.bfloat16: fns["rope_bf16"]} if "rope_bf16" in fns else {}
        mlps, norms = [], []
        for parent in model.modules():
            for name, child in parent.named_children():
                if _same_forward(child, _NORM_SOURCE) and child.weight.dtype == torch.bfloat16:
                    norms.append((parent, name, FusedRMSNorm(child, fns["rms_norm_bf16"])))
                elif _same_forward(child, _MLP_SOURCE) and _silu(child.act_fn):
                    mlps.append((parent, name, FusedMLP(child, fns["silu_mul_bf16"])))
    else:
        return 0
    for parent, name, fused in norms + mlps:
        setattr(parent, name, fused)
    rotary = sum(_fuse_rotary(m, rope) for m in model.modules()) if rope else 0
    if norms or mlps or rotary:
        log.info("%s elementwise ops fused: %d RMSNorms, %d SiLU * up, the rotary embedding in %d attention "
                 "modules", str(dtype).removeprefix("torch."), len(norms), len(mlps), rotary)
    return len(norms) + len(mlps) + rotary
