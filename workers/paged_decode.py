"""Decode attention that reads the paged KV pool in place: a small C kernel, built on first use.

A decode step's attention is one query per request over its whole context. Through SDPA that means
gathering every request's blocks into a padded copy first (`paged_attention._gather`), then reading
the copy through a transposed view: at 16 requests of 650 tokens, 58 % of a `small` llava decode
step (bench/README.md, "Where a decode step's time goes"). The kernel (csrc/paged_decode.c) walks each
request's block table instead and reads each K and V row once, for all the query heads that share it.

It is plain C (no torch headers), compiled with the host's `cc` into the user's cache the first
time a worker needs it (about a second), and called through ctypes, which releases the GIL. On a
host with AVX-512 (-march=native), 16 tokens' scores are reduced at once and a bfloat16 query meets
its keys in `vdpbf16ps` (bench/README.md, "bf16 on the CPU": 1.4x in float32 and 2.4x in bfloat16
over the kernel before it, on an AMD EPYC host), and P @ V sums stay in registers; elsewhere the
portable C runs (tested on every host: the tests build it too). Both prefetch each request's rows
into L2 two blocks ahead, which on that host took the step from ~9 GB/s to memory's pace.
Float32 and bfloat16 pools; exact-length attention (reduced precision's default,
paged_attention.exact_lengths) keeps one SDPA call per length, since only that gives HF's bits, so
in bfloat16 the kernel runs with `--attention padded`. Where no
compiler is found (the offline deploy image has none) or `MSERVE_DECODE_KERNEL=off`, `kernel()` is
None and attention gathers as before; either way the tokens are HF generate's
(tests/workers/test_paged_decode.py, and the engine tests, which run with it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# One library: this kernel, the prompt kernel (workers/paged_prefill.py), the bf16 elementwise ops
# (workers/fused_ops.py) and the helpers they share.
SOURCES = (SOURCE, SOURCE.with_name("paged_prefill.c"), SOURCE.with_name("fused_ops.c"))
HEADERS = (SOURCE.with_name("simd.h"),)
MAX_HEADS = 256  # the kernel's per-head buffers
MAX_ROW = 8192  # values in one token's K (or V) row, or its query, all heads: the kernel's widening buffers
_FLAGS = (["-O3", "-march=native"], ["-O3"])  # the second where the compiler does not know the host
_UNSET = object()
_kernel: object = _UNSET


def _cache_dir() -> Path:
    root = os.environ.get("MSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mserve", "kernels")
    return Path(root)


def _host_key() -> str:
    """What a -march=native build depends on besides its source: the machine and its CPU's flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    return hashlib.sha256((platform.machine() + flags).encode() + sources).hexdigest()[:16]


def compile_library(cc: str, flags: list[str], out: Path) -> str | None:
    """Build SOURCES into the shared library `out` with `flags`; None on success, else the compiler's
    complaint. Built under a temporary name and renamed: workers starting together never load a
    half-written file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    res = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES), "-lm"],
                         capture_output=True, text=True)
    if res.returncode == 0:
        os.replace(tmp, out)
        return None
    os.unlink(tmp)
    return res.stderr.strip()[-500:]


def _build() -> Path | None:
    """The kernel's shared library: already in the cache (built here before, or mounted in), or built now."""
    out = _cache_dir() / f"paged_decode-{_host_key()}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("decode attention: no C compiler (cc, gcc) to build %s, so it gathers each request's KV "
                 "blocks first (the same tokens, slower at long contexts)", out.name)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAGS:
        error = compile_library(cc, flags, out)
        if error is None:
            log.info("decode attention: built %s (%s)", out, " ".join(flags))
            return out
        errors.append(error)
    log.warning("decode attention: %s could not build %s, so it gathers the KV blocks first: %s",
                cc, SOURCE.name, errors[-1])
    return None


def load(path: Path) -> dict:
    """The C functions of a built library by pool dtype, and the prompt kernel's ("prefill_bf16",
    "prefill_scratch_words") and the elementwise ops' ("rms_norm_bf16", "silu_mul_bf16") where it has
    them (built only where the CPU has AVX512_BF16)."""
    lib = ctypes.CDLL(str(path))
    fns = {torch.float32: lib.paged_decode_f32, torch.bfloat16: lib.paged_decode_bf16}
    for fn in fns.values():
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    if hasattr(lib, "paged_prefill_bf16"):
        fns["prefill_bf16"] = lib.paged_prefill_bf16
        fns["prefill_bf16"].restype = ctypes.c_int
        fns["prefill_bf16"].argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float]
        fns["prefill_scratch_words"] = lib.paged_prefill_scratch_words
        fns["prefill_scratch_words"].restype = ctypes.c_int64
        fns["prefill_scratch_words"].argtypes = [ctypes.c_int64] * 4
    if hasattr(lib, "rms_norm_bf16"):  # the same: built only with AVX512_BF16
        fns["rms_norm_bf16"] = lib.rms_norm_bf16
        fns["rms_norm_bf16"].restype = ctypes.c_int
        fns["rms_norm_bf16"].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float]
        fns["silu_mul_bf16"] = lib.silu_mul_bf16
        fns["silu_mul_bf16"].restype = None
        fns["silu_mul_bf16"].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    return fns


def kernel():
    """The loaded C functions by pool dtype (and the prompt kernel's, "prefill_bf16", where built), or
    None (no compiler, a failed build, or MSERVE_DECODE_KERNEL=off)."""
    global _kernel
    if _kernel is _UNSET:
        _kernel = None
        if os.environ.get("MSERVE_DECODE_KERNEL", "auto").lower() not in ("off", "0", "false", "no"):
            try:
                path = _build()
                if path is not None:
                    _kernel = load(path)
                    log.info("decode attention: reads the KV pool in place (%s)", path)
            except OSError as exc:
                log.warning("decode attention: could not load the kernel (%s); it gathers the KV blocks first", exc)
    return _kernel


def usable(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this decode group's attention can run in the kernel. Not inside a torch.compile graph
    (`--compile`): dynamo cannot trace a ctypes call, and a graph break per layer costs what the
    compiled step gains (bench/README.md); compiled decode keeps the gather."""
    heads, kv_heads = query.shape[0], k_cache.shape[2]
    return (not torch.compiler.is_compiling() and query.dtype == k_cache.dtype in (torch.float32, torch.bfloat16)
            and query.device.type == "cpu" and heads % kv_heads == 0 and heads <= MAX_HEADS
            and max(kv_heads, heads) * k_cache.shape[3] <= MAX_ROW and kernel() is not None)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """q [G, heads, head_dim] (one query per request) over each request's first `lens[g]` pooled
    tokens, read in place through `tables` [G, max_blocks] -> [G, heads, head_dim], in q's dtype.
    The query comes in the pool's dtype (bfloat16 products are exact in float32); the scores, the
    softmax and the sums are float32."""
    fn = kernel()[k_cache.dtype]
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
