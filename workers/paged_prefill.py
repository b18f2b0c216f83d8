"""Prompt attention that reads the paged KV pool in place, in bfloat16: a C kernel (csrc/paged_prefill.c).

A prompt chunk's attention through SDPA means gathering its request's blocks (a later chunk also
builds a causal mask over them), then torch's CPU flash-attention kernel. In bfloat16 on this AMD host
that kernel ran at about 50 GFLOP/s, 45 % of a prefill step, while bfloat16 matrix multiplies ran at
460 (bench/lab/NOTEBOOK.md, "bf16 on the CPU"). This kernel multiplies bfloat16 pairs with
`vdpbf16ps` (exact products, float32 sums) and keeps the softmax in float32, rounding the
probabilities to bfloat16 before P @ V, as bfloat16 attention kernels do.

The vision tower's attention (every patch sees every patch) runs through the same kernel with the
causal mask off (vision_attention_forward), under the same conditions.

It runs only with `--attention padded` in bfloat16 (EngineConfig.exact_attention False), which does not
promise HF generate's bits; exact-length attention and float32 keep SDPA. Built with the decode kernel
into one library (workers/kernels.py), on hosts whose CPU has AVX512_BF16; elsewhere SDPA runs.

Where the CPU has AMX, torch's SDPA multiplies on its tiles and beat the `vdpbf16ps` products 2.3x on
a 673-token prompt and 3.9x on a vision layer (`vdpbf16ps` runs at half its AMD rate there;
bench/lab/NOTEBOOK.md, "an Intel Xeon with AMX"). So there the kernel runs only where its own build
multiplies on the tiles too (`kernels.library()["prefill_amx"]`, a -march=native build on such a
CPU) and the head size is a multiple of 32, a tile's row; it then beat gather + SDPA 1.2-2.4x
(bench/lab/NOTEBOOK.md, "Prompt attention on AMX tiles"). Otherwise SDPA runs there (`policy`).
`MSERVE_PROMPT_KERNEL=on` or `off` overrides that choice.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mserve.workers import kernels, paged_decode

VISION_ATTN_IMPLEMENTATION = "mserve_vision"
log = logging.getLogger(__name__)


def _amx() -> bool:
    """Whether torch can multiply on AMX tiles on this CPU (the flag, and the OS letting a process use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def _kernel_amx() -> bool:
    """Whether the loaded kernel multiplies on AMX tiles (built with them, and the OS granted them)."""
    fns = kernels.library()
    return bool(fns and "prefill_amx" in fns and fns["prefill_amx"]())


@functools.cache
def policy() -> tuple[bool, int]:
    """(whether prompt and vision attention should run in the kernel on this host rather than in SDPA,
    the head size it must be a multiple of for that). MSERVE_PROMPT_KERNEL=on or off, else (auto): the
    kernel where the CPU has no AMX, or where the kernel's products run on AMX tiles too (head sizes
    that fill a tile's row); SDPA on an AMX CPU whose kernel build has no tiles. Read once a process."""
    if kernels.switched_off("MSERVE_PROMPT_KERNEL"):  # off, 0, false, no: as the other switches read
        return False, 16
    choice = os.environ.get("MSERVE_PROMPT_KERNEL", "auto").strip().lower()
    if choice in ("on", "1", "true", "yes"):
        return True, 16
    if choice != "auto":
        raise ValueError(f"MSERVE_PROMPT_KERNEL must be auto, on or off, not {choice!r}")
    if not _amx():
        return True, 16
    if _kernel_amx():
        log.info("prompt and vision attention: the kernel, multiplying on this CPU's AMX tiles (head sizes "
                 "that are multiples of 32; SDPA for others)")
        return True, 32
    log.info("prompt and vision attention: torch's SDPA, which multiplies on this CPU's AMX tiles (the "
             "kernel's build has no tiles; MSERVE_PROMPT_KERNEL=on to use it anyway)")
    return False, 16


def preferred() -> bool:
    """Whether prompt and vision attention should run in the kernel on this host (`policy`)."""
    return policy()[0]


def usable(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a group of prompt chunks (query [heads, rows, head_dim]) can and should (`policy`) run
    in the kernel."""
    heads, _, d = query.shape
    kv_heads = k_cache.shape[2]
    if torch.compiler.is_compiling() or not (query.dtype == k_cache.dtype == torch.bfloat16) or not preferred():
        return False
    fns = kernels.library()
    return (fns is not None and "prefill_bf16" in fns and query.device.type == "cpu" and d % policy()[1] == 0
            and d <= 256 and heads % kv_heads == 0 and heads <= paged_decode.MAX_HEADS)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           starts: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """q [G, n, heads, head_dim]: chunk g's token i is at position starts[g] + i and attends causally to
    its request's pooled keys up to itself, through `tables` [G, max_blocks] -> [G, n, heads, head_dim].
    `causal` False: every token attends to all starts[g] + n keys."""
    fns = kernels.library()
    q = q.contiguous()
    g, n, heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and tables.dtype == starts.dtype == torch.int64
    tables, starts = tables.contiguous(), starts.contiguous()
    max_len = int(starts.max()) + n
    out = torch.empty(q.shape, dtype=torch.float32)
    scratch = torch.empty(fns["prefill_scratch_words"](heads, kv_heads, d, max_len), dtype=torch.int32)
    rc = fns["prefill_bf16"](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                             starts.data_ptr(), out.data_ptr(), scratch.data_ptr(), g, n, heads, kv_heads, d, bs,
                             tables.shape[1], max_len, int(causal), scale)
    if rc != 0:
        raise ValueError(f"paged prefill: chunks of {n} tokens from positions {starts.tolist()} do not fit "
                         f"their {tables.shape[1]} blocks of {bs}" if rc == -1 else
                         f"paged prefill: shapes the kernel does not take (heads {heads}, kv heads {kv_heads}, "
                         f"head size {d})")
    return out.to(q.dtype)


def vision_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function for a vision tower: query/key/value [B, heads, L, head_dim] ->
    [B, L, heads, head_dim]. Unmasked self-attention goes to the kernel, the keys of image b as pool
    block b of L tokens; anything else (a mask, causal, dropout, another shape) to SDPA."""
    b, heads, n, d = query.shape
    if (attention_mask is None and not getattr(module, "is_causal", False) and dropout == 0.0
            and key.shape[2] == n and usable(query[0], key.transpose(1, 2))):
        k, v = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()  # [B, L, kv_heads, d]
        tables = torch.arange(b, dtype=torch.long).view(b, 1)
        out = attend(query.transpose(1, 2), k, v, tables, torch.zeros(b, dtype=torch.long),
                     scaling if scaling is not None else d ** -0.5, causal=False)
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


AttentionInterface.register(VISION_ATTN_IMPLEMENTATION, vision_attention_forward)
# Masks for it as for SDPA: transformers builds no mask at all for an attention name it has no mask function
# for, and a tower whose mask is not all-True (Gemma 4's padding patches) then attends to every patch.
AttentionMaskInterface.register(VISION_ATTN_IMPLEMENTATION, sdpa_mask)


def use_for_vision(model: torch.nn.Module) -> bool:
    """Route the vision tower's SDPA attention through vision_attention_forward (bfloat16, padded
    attention: ModelRunner decides). True if it did."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None or getattr(vision, "_attn_implementation", None) != "sdpa":
        return False
    vision._attn_implementation = VISION_ATTN_IMPLEMENTATION
    return True
