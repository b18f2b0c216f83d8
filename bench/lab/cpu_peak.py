"""One core's arithmetic peak, so that a kernel's GFLOP/s can be read against it (issue 20).

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.cpu_peak [--seconds 1]

Builds a loop of 12 independent AVX-512 accumulators (enough to hide each instruction's latency) with
the host's `cc -march=native` and times it: float32 FMA (`vfmadd`, 32 FLOP an instruction) and, where
the CPU has AVX512_BF16, `vdpbf16ps` (64 FLOP). Hosts of the same name differ: an AMD EPYC that
double-pumps 512-bit instructions gives half the bf16 peak of one that does not, and everything else
(oneDNN's GEMMs, the attention kernels) follows. Vendors differ more: on an Intel Xeon with AMX,
`vdpbf16ps` ran at half the FMA's GFLOP/s (105 against 212: one issued every other cycle), where the
AMD hosts gave twice it; oneDNN's bf16 GEMMs use AMX's tiles there instead. Prints one line per instruction; no AVX-512, no line.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#define ACC(op) a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5); \
                a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11);
#define INIT __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2), \
    a3 = _mm512_set1_ps(3), a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5), a6 = _mm512_set1_ps(6), \
    a7 = _mm512_set1_ps(7), a8 = _mm512_set1_ps(8), a9 = _mm512_set1_ps(9), a10 = _mm512_set1_ps(10), \
    a11 = _mm512_set1_ps(11);
#define SUM _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), \
    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)), \
    _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)))))
/* each returns the sum of its accumulators, so that none of the work can be left out */
float fma_loop(int64_t n) {
    INIT
    __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
#define FMA(a) _mm512_fmadd_ps(a, x, y)
    for (int64_t i = 0; i < n; i++) { ACC(FMA) __asm__ volatile("" : "+v"(x)); }
    return SUM;
}
#ifdef __AVX512BF16__
float dpbf16_loop(int64_t n) {
    INIT
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00); /* bf16 0.0078125 */
#define DPBF16(a) _mm512_dpbf16_ps(a, x, x)
    for (int64_t i = 0; i < n; i++) { ACC(DPBF16) __asm__ volatile("" : "+v"(x)); }
    return SUM;
}
#endif
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.cpu_peak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.0, help="about how long each loop runs (default 1)")
    args = p.parse_args(argv)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc, gcc)")
    tmp = Path(tempfile.mkdtemp(prefix="cpu-peak-"))
    (tmp / "peak.c").write_text(SOURCE)
    res = subprocess.run([cc, "-O2", "-march=native", "-shared", "-fPIC", "-o", str(tmp / "peak.so"),
                          str(tmp / "peak.c")], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"no AVX-512 build on this host: {res.stderr.strip()[-300:]}")
        return 0
    lib = ctypes.CDLL(str(tmp / "peak.so"))
    for name, flop in (("fma_loop", 32), ("dpbf16_loop", 64)):
        if not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_int64]
        n = 1_000_000
        while True:  # grow the loop until it runs about --seconds
            t = time.perf_counter()
            fn(n)
            dt = time.perf_counter() - t
            if dt >= args.seconds / 4:
                break
            n *= 4
        n = int(n * args.seconds / dt)
        t = time.perf_counter()
        fn(n)
        dt = time.perf_counter() - t
        per_s = 12 * n / dt
        print(f"{name[:-5]:8} {per_s / 1e9:6.2f} G instructions/s, {per_s * flop / 1e9:5.0f} GFLOP/s on one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
