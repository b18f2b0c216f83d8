"""Prompt attention that reads the paged KV pool in place, in bfloat16: a C kernel (csrc/paged_prefill.c).

A prompt chunk's attention through SDPA means gathering its request's blocks (a later chunk also
builds a causal mask over them), then torch's CPU flash-attention kernel. In bfloat16 on this AMD host
that kernel ran at about 50 GFLOP/s, 45 % of a prefill step, while bfloat16 matrix multiplies ran at
460 (bench/README.md, "Prompt attention in place"). This kernel multiplies bfloat16 pairs with
`vdpbf16ps` (exact products, float32 sums) and keeps the softmax in float32, rounding the
probabilities to bfloat16 before P @ V, as bfloat16 attention kernels do.

It runs only with `--attention padded` in bfloat16 (EngineConfig.exact_attention False), which does not
promise HF generate's bits; exact-length attention and float32 keep SDPA. Built with the decode kernel
into one library (paged_decode.kernel()), on hosts whose CPU has AVX512_BF16; elsewhere SDPA runs.
"""

from __future__ import annotations

import torch

from mserve.workers import paged_decode


def usable(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a group of prompt chunks (query [heads, rows, head_dim]) can run in the kernel."""
    heads, _, d = query.shape
    kv_heads = k_cache.shape[2]
    if torch.compiler.is_compiling() or not (query.dtype == k_cache.dtype == torch.bfloat16):
        return False
    fns = paged_decode.kernel()
    return (fns is not None and "prefill_bf16" in fns and query.device.type == "cpu" and d % 16 == 0
            and d <= 256 and heads % kv_heads == 0 and heads <= paged_decode.MAX_HEADS)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           starts: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, n, heads, head_dim]: chunk g's token i is at position starts[g] + i and attends causally to
    its request's pooled keys up to itself, through `tables` [G, max_blocks] -> [G, n, heads, head_dim]."""
    fns = paged_decode.kernel()
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
                             tables.shape[1], max_len, scale)
    if rc != 0:
        raise ValueError(f"paged prefill: chunks of {n} tokens from positions {starts.tolist()} do not fit "
                         f"their {tables.shape[1]} blocks of {bs}" if rc == -1 else
                         f"paged prefill: shapes the kernel does not take (heads {heads}, kv heads {kv_heads}, "
                         f"head size {d})")
    return out.to(q.dtype)
