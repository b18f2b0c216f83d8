"""The bf16 prompt attention kernel alone (workers/csrc/paged_prefill.c): this checkout's build beside a git
revision's, on the same inputs.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.prompt_kernel [--against REV] [--rounds 3]

Cases, the peer's `small` llava's shapes over a pool of 2,048 blocks of 16 whose blocks lie scattered: a
673-token prompt from position 0, a later chunk of 161 tokens from 512, two chunks of 300 in one call,
and a vision layer without the causal mask (577 patches, 16 heads as CLIP-L, and 4 as the `small`
tower). For each case: whether `--against`'s output has this build's bits (else the largest
difference), then the median ms of 20 calls a round, the builds interleaved round by round. Needs a CPU
with AVX512_BF16 (the kernel is built only there). Used for bench/lab/NOTEBOOK.md, "The prompt kernel's registers".

Where this build multiplies on AMX tiles (paged_prefill_amx), it also runs with them off ("this,
vdpbf16ps"), and `--sdpa` adds what the kernel replaces: the request's blocks gathered and torch's SDPA
(a bool mask for a chunk after a prefix), in bf16. Each variant's largest difference from the first
variant is printed, and `--against`'s from this build's same products (on tiles where both have them,
else "this, vdpbf16ps"). Used for bench/lab/NOTEBOOK.md, "Prompt attention on AMX tiles".
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
    for name in ("paged_prefill.c", "simd.h", "amx.h"):  # amx.h: since the AMX products
        if rev is None:
            (folder / name).write_text((CSRC / name).read_text())
            continue
        res = subprocess.run(["git", "show", f"{rev}:workers/csrc/{name}"], cwd=CSRC, capture_output=True, text=True)
        if res.returncode == 0:
            (folder / name).write_text(res.stdout)
        elif name == "paged_prefill.c":
            raise SystemExit(f"no prompt kernel at {rev}: {res.stderr.strip()}")
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
    p.add_argument("--sdpa", action="store_true", help="also time gather + torch SDPA, as the engine runs it")
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
    amx = ctypes.CDLL(str(tmp / "this.so"))
    against_tiles = bool(args.against) and bool(getattr(ctypes.CDLL(str(tmp / "against.so")), "paged_prefill_amx",
                                                        lambda: 0)())  # then "this, AMX" is its peer
    variants = dict(builds)
    if hasattr(amx, "paged_prefill_amx") and amx.paged_prefill_amx():
        amx.paged_prefill_use_amx.argtypes = [ctypes.c_int64]
        variants = {"this, AMX": "this", "this, vdpbf16ps": "this"}
        variants.update({b: b for b in builds if b != "this"})
    else:
        variants = {b: b for b in builds}
    if args.sdpa:
        variants["gather + SDPA"] = None
    bs, blocks, d = 16, 2048, 64
    for name, g, n, heads, kv, starts, causal in CASES:
        k, v = (torch.randn(blocks, bs, kv, d).bfloat16() for _ in range(2))
        max_len = max(starts) + n
        mb = -(-max_len // bs)
        tables = torch.stack([torch.randperm(blocks)[:mb] for _ in range(g)]).contiguous()
        first = torch.tensor(starts, dtype=torch.int64)
        q = torch.randn(g, n, heads, d).bfloat16()
        outs, times = {}, {b: [] for b in variants}

        def sdpa():
            from torch.nn.functional import scaled_dot_product_attention as attention
            res = []
            for i in range(g):  # each chunk: its blocks gathered [1, kv, len, d], a mask after a prefix
                length = starts[i] + n
                kk, vv = (x[tables[i]].reshape(-1, kv, d)[:length].transpose(0, 1)[None] for x in (k, v))
                qq = q[i].transpose(0, 1)[None]
                mask = None
                if causal and starts[i]:
                    mask = torch.arange(length)[None] <= (starts[i] + torch.arange(n))[:, None]
                res.append(attention(qq, kk, vv, attn_mask=mask, is_causal=bool(causal and not starts[i]),
                                     scale=d ** -0.5, enable_gqa=heads != kv)[0].transpose(0, 1))
            return torch.stack(res).float()

        def call(name):
            b = variants[name]
            if b is None:
                return sdpa()
            if b == "this" and name.startswith("this, "):
                amx.paged_prefill_use_amx(int(name == "this, AMX"))
            kernel, words = builds[b]
            scratch = torch.empty(words(heads, kv, d, max_len), dtype=torch.int32)
            out = torch.empty(q.shape, dtype=torch.float32)
            rc = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), first.data_ptr(), out.data_ptr(),
                        scratch.data_ptr(), g, n, heads, kv, d, bs, mb, max_len, causal, d ** -0.5)
            assert rc == 0, rc
            return out

        for b in variants:
            outs[b] = call(b)
        for _ in range(args.rounds):
            for b in variants:
                t = time.perf_counter()
                for _ in range(args.calls):
                    call(b)
                times[b].append((time.perf_counter() - t) / args.calls * 1e3)
        line = f"{name}: " + ", ".join(f"{b} {statistics.median(ts):.3f} ms" for b, ts in times.items())
        first = next(iter(variants))
        pairs = [(first, b) for b in list(variants)[1:]]
        if args.against and "this, vdpbf16ps" in variants and not against_tiles:  # the same products in both
            pairs.append(("this, vdpbf16ps", args.against))
        for first, b in pairs:
            same = torch.equal(outs[first], outs[b])
            line += f"; {b} vs {first}: the same bits" if same else \
                f"; {b} vs {first}: largest difference {float((outs[first] - outs[b]).abs().max()):.3g}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
