"""What one-pass float32 RMSNorm and SiLU(gate) * up kernels (AVX2) would save a float32 language model's
steps: the ceiling that kept them out of workers/fused_ops.py (issue 20).

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.f32_elementwise --model DIR [--rows 16,490] [--rounds 7]

The candidate kernels (C below, built here with -march=native) against HF's torch ops (Llama's RMSNorm
forward, `silu(gate) * up`) at the checkpoint's hidden and intermediate widths, one thread, best of
`--rounds`. For each row count: us an op both ways, their largest relative difference, and what a step
of that many rows would save with 2L + 1 norms and L MLPs (L: the language model's layers). Needs a
CPU with AVX2 and FMA. Used for bench/lab/NOTEBOOK.md, "Another AVX2 host".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
static inline __m256 exp8(__m256 x) {  /* e^x, x <= 0: 2^n p(r), p of degree 7 */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    for (int k = 0; k < 7; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[k]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* rows of n, n a multiple of 8; plain (not masked) moves: a masked store is microcoded on AMD's cores */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n; float *o = out + r * n;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0); a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        for (; i < n; i += 8) { const __m256 v = _mm256_loadu_ps(xr + i); a0 = _mm256_fmadd_ps(v, v, a0); }
        const __m256 a = _mm256_add_ps(a0, a1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h)); h = _mm_add_ss(h, _mm_movehdup_ps(h));
        const __m256 s = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(h) / (float)n + eps));
        for (i = 0; i < n; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), s)));
    }
}
void silu_mul_f32(const float *g, const float *u, float *out, int64_t count) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < count; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, _mm256_and_ps(x, magnitude)));
        const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
}
"""


def build(folder: Path):
    src, lib = folder / "f32_elementwise.c", folder / "f32_elementwise.so"
    src.write_text(SOURCE)
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(lib), str(src), "-lm"], check=True)
    so = ctypes.CDLL(str(lib))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    so.rms_norm_f32.restype, so.rms_norm_f32.argtypes = None, [p] * 3 + [i64] * 2 + [ctypes.c_float]
    so.silu_mul_f32.restype, so.silu_mul_f32.argtypes = None, [p] * 3 + [i64]
    return so


def best_us(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    p = argparse.ArgumentParser(prog="python -m lab.f32_elementwise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint folder (its text config gives the widths)")
    p.add_argument("--rows", default="16,490", help="rows of a step, comma-separated (default 16,490)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("lab.f32_elementwise: the kernels need a CPU with AVX2")
    torch.set_num_threads(1)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    if hidden % 8 or inter % 8:
        raise SystemExit("lab.f32_elementwise: widths must be multiples of 8")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        so = build(Path(tmp))
        norm = LlamaRMSNorm(hidden, eps=1e-6)
        norm.weight.data = torch.randn(hidden)
        w = norm.weight.detach().contiguous()
        print(f"hidden {hidden}, intermediate {inter}, {layers} layers: {2 * layers + 1} norms and {layers} "
              f"SiLU * up a step")
        for rows in (int(r) for r in args.rows.split(",")):
            x, g, u = torch.randn(rows, hidden) * 4, torch.randn(rows, inter) * 3, torch.randn(rows, inter)
            xo, go = torch.empty_like(x), torch.empty_like(g)
            calls = max(3, 20_000 // rows)
            hf_norm = best_us(lambda: norm(x), calls, args.rounds)
            k_norm = best_us(lambda: so.rms_norm_f32(x.data_ptr(), w.data_ptr(), xo.data_ptr(), rows, hidden, 1e-6),
                             calls, args.rounds)
            hf_mlp = best_us(lambda: torch.nn.functional.silu(g) * u, calls, args.rounds)
            k_mlp = best_us(lambda: so.silu_mul_f32(g.data_ptr(), u.data_ptr(), go.data_ptr(), rows * inter),
                            calls, args.rounds)
            diff = max(((xo - norm(x)).abs() / norm(x).abs().clamp_min(1e-30)).max().item(),
                       ((go - torch.nn.functional.silu(g) * u).abs().max() / (go.abs().max())).item())
            saved = (2 * layers + 1) * (hf_norm - k_norm) + layers * (hf_mlp - k_mlp)
            print(f"{rows:5d} rows: RMSNorm {hf_norm:8.1f} -> {k_norm:7.1f} us, SiLU * up {hf_mlp:8.1f} -> "
                  f"{k_mlp:7.1f} us (largest difference {diff:.1e} relative); a step saves {saved / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
