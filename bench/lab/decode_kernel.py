"""The decode attention kernel alone (workers/csrc/paged_decode.c), builds of it side by side.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.decode_kernel [--against REV] [--portable] [--avx2] [--rounds 3]
        [--blocks scattered|contiguous|descending|shared] [--huge-pages on|off]

Times one decode step's attention over 8 layers' pools (16 requests of 640-700 tokens, blocks scattered
over pools of 2,048 blocks (`--pool-blocks`), the peer's `small` llava shapes: 8 heads, 4 KV heads,
head size 64), in float32 and bfloat16, for this checkout's kernel and, interleaved in the same
process: `--against REV` (the kernel at a git revision, its headers included), `--portable` (built
without -march=native) and `--avx2` (built for AVX2 and FMA, the build AVX2-only hosts get); with
`--against`, each of those is built from both sources. Each build's largest difference from gather + SDPA in float32 is printed first. `--huge-pages on` allocates the
pools as the engine does (workers/huge_pages.py). Used for bench/lab/NOTEBOOK.md, "bf16 on the CPU".
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "workers" / "csrc" / "paged_decode.c"


def build(csrc: Path, flags: list[str], out: Path) -> dict:
    import torch

    subprocess.run(["cc", *flags, "-I", str(csrc), "-shared", "-fPIC", "-o", str(out), str(csrc / SOURCE.name), "-lm"],
                   check=True)  # -I: its headers (csrc/simd.h, csrc/paged_decode_simd.h)
    lib, fns = ctypes.CDLL(str(out)), {}
    for name, dtype in (("paged_decode_f32", torch.float32), ("paged_decode_bf16", torch.bfloat16)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
        fns[dtype] = fn
    return fns


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F

    from mserve.workers import huge_pages

    p = argparse.ArgumentParser(prog="python -m lab.decode_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", help="a git revision whose kernel runs beside this checkout's")
    p.add_argument("--portable", action="store_true", help="also this kernel built without -march=native")
    p.add_argument("--avx2", action="store_true",
                   help="also this kernel built for AVX2 and FMA without AVX-512 (the 8-lane vector build)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--blocks", choices=("scattered", "contiguous", "descending", "shared"), default="scattered",
                   help="where each request's blocks lie: scattered over the pool (default), one run after "
                        "another, runs counting down, or every request on the same blocks (cache-hot: the "
                        "arithmetic alone)")
    p.add_argument("--pool-blocks", type=int, default=2048, help="blocks of 16 tokens in each layer's pool")
    p.add_argument("--huge-pages", choices=("on", "off"), default="off",
                   help="the pools on transparent huge pages as the engine's KVCache allocates them "
                        "(workers/huge_pages.py), or on 4 KiB pages (default)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="decode-kernel-"))
    variants = {"": ["-O3", "-march=native"]}
    if args.portable:
        variants[" portable"] = ["-O3"]
    if args.avx2:
        variants[" avx2"] = ["-O3", "-mavx2", "-mfma"]
    sources = {"this": SOURCE.parent}
    old = ""
    if args.against:  # the revision's csrc folder, headers and all
        rev = tmp / "against"
        rev.mkdir()
        archive = subprocess.run(["git", "archive", args.against, "."], cwd=SOURCE.parent, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(rev)], input=archive, check=True)
        sources[args.against] = rev
        old = (rev / SOURCE.name).read_text()
    builds = {f"{name}{suffix}": build(csrc, flags, tmp / f"{i}-{j}.so")
              for i, (name, csrc) in enumerate(sources.items()) for j, (suffix, flags) in enumerate(variants.items())}
    float_query = {name for name in builds if args.against and name.startswith(args.against)
                   and "int NAME(const float *q," in old}
    heads, kv, d, bs, blocks, layers, g = 8, 4, 64, 16, args.pool_blocks, 8, args.batch
    lens = torch.randint(640, 700, (g,))
    max_len, mb = int(lens.max()), int(-(-lens.max() // bs))
    if g * mb > blocks:
        p.error(f"--pool-blocks {blocks} cannot hold {g} requests of {mb} blocks")
    if args.blocks == "scattered":
        tables = torch.stack([torch.randperm(blocks)[:mb] for _ in range(g)]).contiguous()
    elif args.blocks == "descending":  # runs of ids counting down: a pool that has turned over (BlockPool.free)
        tables = torch.arange(g * mb).view(g, mb).flip(1).contiguous()
    elif args.blocks == "contiguous":
        tables = torch.arange(g * mb).view(g, mb).contiguous()
    else:
        tables = torch.arange(mb)[None].repeat(g, 1).contiguous()

    def call(name, fns, q, kc, vc):
        # kernels before 364cfb5 took a float32 query whatever the pool (their scratch: heads * max_len)
        qq = q.float().contiguous() if name in float_query else q.contiguous()
        out = torch.empty(q.shape, dtype=torch.float32)
        scratch = torch.empty(heads * (max_len + 16), dtype=torch.float32)
        rc = fns[kc.dtype](qq.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                           out.data_ptr(), scratch.data_ptr(), g, heads, kv, d, bs, mb, max_len, d ** -0.5)
        assert rc == 0
        return out

    def pool(dtype):
        t = huge_pages.zeros((blocks, bs, kv, d), dtype) if args.huge_pages == "on" else torch.empty(blocks, bs, kv, d, dtype=dtype)
        return t.copy_(torch.randn(blocks, bs, kv, d))

    for dtype in (torch.float32, torch.bfloat16):
        pools = [(pool(dtype), pool(dtype)) for _ in range(layers)]
        q = (torch.randn(g, heads, d) * 3).to(dtype)
        kc, vc = pools[0]
        k = kc.float()[tables.view(-1)].view(g, mb * bs, kv, d).transpose(1, 2)
        v = vc.float()[tables.view(-1)].view(g, mb * bs, kv, d).transpose(1, 2)
        mask = (torch.arange(mb * bs)[None] < lens[:, None])[:, None, None]
        want = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=mask, scale=d ** -0.5,
                                              enable_gqa=True)[:, :, 0]
        for name, fns in builds.items():
            err = (call(name, fns, q, kc, vc) - want).abs().max().item()
            print(f"{str(dtype):15} {name:16} largest difference from gather + SDPA: {err:.2e}")
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, fns in builds.items():
                t = time.perf_counter()
                for _ in range(5):
                    for kc, vc in pools:
                        call(name, fns, q, kc, vc)
                times[name].append((time.perf_counter() - t) / 5 * 1e3)
        for name, ts in times.items():
            print(f"{str(dtype):15} {name:16} " + " / ".join(f"{t:.2f}" for t in ts) + f" ms a step ({layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
