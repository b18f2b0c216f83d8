"""Decode attention that reads the paged KV pool in place: a small C kernel, built on first use.

A decode step's attention is one query per request over its whole context. Through SDPA that means
gathering every request's blocks into a padded copy first (`paged_attention._gather`), then reading
the copy through a transposed view: at 16 requests of 650 tokens, 58 % of a `small` llava decode
step (bench/lab/NOTEBOOK.md, "Where a decode step's time goes"). The kernel (csrc/paged_decode.c) walks each
request's block table instead and reads each K and V row once, for all the query heads that share it.

The kernel is built with the others into one library (workers/kernels.py). On a host with
AVX-512 (-march=native), 16 tokens' scores are reduced at once and a bfloat16 query meets
its keys in `vdpbf16ps` (bench/lab/NOTEBOOK.md, "bf16 on the CPU": 1.4x in float32 and 2.4x in bfloat16
over the kernel before it, on an AMD EPYC host), and P @ V sums stay in registers; with AVX2 and FMA
but no AVX-512 the same code runs 8 lanes wide (csrc/paged_decode_simd.h: one body, the lane width
and its operations chosen by the build); elsewhere the portable C
runs (the tests build all three where the CPU can run them). All prefetch each request's rows into L2
two blocks ahead, which on that host took the step from ~9 GB/s to memory's pace.
Float32 and bfloat16 pools; exact-length attention (`--attention exact`, paged_attention.exact_setting)
keeps one SDPA call per length, since only that gives HF's bits at bf16 ties, so the kernel runs with
padded attention, the default. Where the library is not built (no compiler:
the offline deploy image has none) or `MSERVE_DECODE_KERNEL=off`, attention gathers as before;
either way the tokens are HF generate's (tests/workers/test_paged_decode.py, and the engine tests,
which run with it).
"""

from __future__ import annotations

import torch

from mserve.workers import kernels

MAX_HEADS = 256  # the kernel's per-head buffers
MAX_ROW = 8192  # values in one token's K (or V) row, or its query, all heads: the kernel's widening buffers


def usable(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this decode group's attention can run in the kernel. Not inside a torch.compile graph
    (`--compile`): dynamo cannot trace a ctypes call, and a graph break per layer costs what the
    compiled step gains (bench/lab/NOTEBOOK.md); compiled decode keeps the gather."""
    heads, kv_heads = query.shape[0], k_cache.shape[2]
    return (not torch.compiler.is_compiling() and query.dtype == k_cache.dtype in (torch.float32, torch.bfloat16)
            and query.device.type == "cpu" and heads % kv_heads == 0 and heads <= MAX_HEADS
            and max(kv_heads, heads) * k_cache.shape[3] <= MAX_ROW and kernels.library() is not None)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """q [G, heads, head_dim] (one query per request) over each request's first `lens[g]` pooled
    tokens, read in place through `tables` [G, max_blocks] -> [G, heads, head_dim], in q's dtype.
    The query comes in the pool's dtype (bfloat16 products are exact in float32); the scores, the
    softmax and the sums are float32."""
    fn = kernels.library()[k_cache.dtype]
    q = q.contiguous()
    g, heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and tables.dtype == lens.dtype == torch.int64
    tables, lens = tables.contiguous(), lens.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    scratch = torch.empty(heads * -(-max_len // 16) * 16, dtype=torch.float32)  # rows of whole 16-token tiles
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), scratch.data_ptr(), g, heads, kv_heads, d, bs, tables.shape[1], max_len, scale)
    if rc != 0:  # usable() keeps the head count in range: only a length can be wrong here
        raise ValueError(f"paged decode: a context length outside 1..{max_len} in {lens.tolist()}")
    return out.to(q.dtype)
