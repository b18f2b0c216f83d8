"""The bf16 prompt attention kernel alone (workers/csrc/paged_prefill.c): this checkout's build beside a git
revision's, on the same inputs.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.prompt_kernel [--against REV] [--rounds 3]

Cases, the peer's `small` llava's shapes over a pool of 2,048 blocks of 16 whose blocks lie scattered: a
673-token prompt from position 0, a later chunk of 161 tokens from 512, two chunks of 300 in one call,
and a vision layer without the causal mask (577 patches, 16 heads as CLIP-L, and 4 as the `small`
tower). For each case: whether `--against`'s output has this build's bits (else the largest
difference), then the median ms of 20 calls a round, the builds interleaved round by round. Needs a CPU
with AVX512_BF16 (the kernel is built only there). Used for bench/README.md, "The prompt kernel's registers".
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "workers" / "csrc"
# (name, chunks, chunk tokens, heads, kv heads, first positions, causal)
CASES = (("prompt, 673 tokens from 0", 1, 673, 8, 4, (0,), 1),
         ("chunk, 161 tokens from 512", 1, 161, 8, 4, (512,), 1),
         ("two chunks of 300", 2, 300, 8, 4, (0, 37), 1),
         ("vision, 577 patches x 16 heads", 1, 577, 16, 16, (0,), 0),
         ("vision, 577 patches x 4 heads", 1, 577, 4, 4, (0,), 0))


def build(rev: str | None, out: Path):
    """The kernel at `rev` (None: this checkout) built with -march=native; its (kernel, scratch size) calls,
    or None where this CPU has no AVX512_BF16 (the source then compiles to nothing)."""
    folder = out.parent / (out.stem + "-src")
    folder.mkdir()
    for name in ("paged_prefill.c", "simd.h"):
        text = (CSRC / name).read_text() if rev is None else subprocess.run(
            ["git", "show", f"{rev}:workers/csrc/{name}"], cwd=CSRC, capture_output=True, text=True, check=True).stdout
        (folder / name).write_text(text)
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(out), str(folder / "paged_prefill.c"),
                    "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    if not hasattr(lib, "paged_prefill_bf16"):
        return None
    kernel, words = lib.paged_prefill_bf16, lib.paged_prefill_scratch_words
    kernel.restype, kernel.argtypes = ctypes.c_int, [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float]
    words.restype, words.argtypes = ctypes.c_int64, [ctypes.c_int64] * 4
    return kernel, words


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m lab.prompt_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", help="a git revision whose kernel runs beside this checkout's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20, help="calls a round per build and case (default 20)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="prompt-kernel-"))
    builds = {"this": build(None, tmp / "this.so")}
    if builds["this"] is None:
        print("this CPU has no AVX512_BF16: the bf16 prompt kernel is not built here")
        return 0
    if args.against:
        builds[args.against] = build(args.against, tmp / "against.so")
    bs, blocks, d = 16, 2048, 64
    for name, g, n, heads, kv, starts, causal in CASES:
        k, v = (torch.randn(blocks, bs, kv, d).bfloat16() for _ in range(2))
        max_len = max(starts) + n
        mb = -(-max_len // bs)
        tables = torch.stack([torch.randperm(blocks)[:mb] for _ in range(g)]).contiguous()
        first = torch.tensor(starts, dtype=torch.int64)
        q = torch.randn(g, n, heads, d).bfloat16()
        outs, times = {}, {b: [] for b in builds}

        def call(b):
            kernel, words = builds[b]
            scratch = torch.empty(words(heads, kv, d, max_len), dtype=torch.int32)
            out = torch.empty(q.shape, dtype=torch.float32)
            rc = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), first.data_ptr(), out.data_ptr(),
                        scratch.data_ptr(), g, n, heads, kv, d, bs, mb, max_len, causal, d ** -0.5)
            assert rc == 0, rc
            return out

        for b in builds:
            outs[b] = call(b)
        for _ in range(args.rounds):
            for b in builds:
                t = time.perf_counter()
                for _ in range(args.calls):
                    call(b)
                times[b].append((time.perf_counter() - t) / args.calls * 1e3)
        line = f"{name}: " + ", ".join(f"{b} {statistics.median(ts):.3f} ms" for b, ts in times.items())
        if args.against:
            same = torch.equal(outs["this"], outs[args.against])
            line += "; the same bits" if same else \
                f"; largest difference {float((outs['this'] - outs[args.against]).abs().max()):.3g}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
