"""bf16 prompt attention and linear layers on the CPU: the kernels the engine uses against what they replace.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.bf16_ops [--rounds 3]

Prompt attention, one layer of the peer's `small` llava (8 heads, 4 KV heads, head size 64, a pool of
2,048 blocks of 16): the gather + SDPA path (`is_causal` for a first chunk, the causal mask for a later
one) against `paged_prefill.attend`, for a whole 673-token prompt, a first chunk of 512 and the 161
tokens after it. Vision attention: 577 patches, 16 heads of 64 (CLIP-L/14 at 336 px), SDPA against
`paged_prefill.vision_attention_forward`. Linear layers (the `small` llava's MLP and LM head shapes):
`F.linear` against `PackedLinear` at 1, 16 and 512 rows (no bias), with a check that the bits are the same.
Median ms of 10 calls a round, interleaved. Used for bench/lab/NOTEBOOK.md, "bf16 on the CPU".
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn, reps: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from mserve.workers import packed_linear, paged_prefill
    from mserve.workers.paged_attention import _gather

    p = argparse.ArgumentParser(prog="python -m lab.bf16_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows: dict[str, list[float]] = {}

    def record(name, fn):
        rows.setdefault(name, []).append(timed(fn))

    heads, kv, d, bs, blocks = 8, 4, 64, 16, 2048
    k_cache, v_cache = (torch.randn(blocks, bs, kv, d).bfloat16() for _ in range(2))
    cases = []
    for n, start in ((673, 0), (512, 0), (161, 512)):
        tables = torch.randperm(blocks)[: -(-(start + n) // bs)][None].contiguous()
        q = torch.randn(1, n, heads, d).bfloat16()
        starts = torch.tensor([start])

        def sdpa(q=q, tables=tables, n=n, start=start, starts=starts):
            k, v = _gather(k_cache, tables), _gather(v_cache, tables)
            if start == 0:
                return F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :, :n], v[:, :, :n], is_causal=True,
                                                      enable_gqa=True)
            pos = starts[:, None] + torch.arange(n)[None]
            mask = (torch.arange(k.shape[2])[None, None] <= pos[:, :, None])[:, None]
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)

        def kernel(q=q, tables=tables, starts=starts):
            return paged_prefill.attend(q, k_cache, v_cache, tables, starts, d ** -0.5)

        cases.append((f"prompt attention, {n} tokens from {start}", sdpa, kernel))
    vq, vk, vv = (torch.randn(1, 16, 577, 64).bfloat16() for _ in range(3))
    cases.append(("vision attention, 577 patches",
                  lambda: F.scaled_dot_product_attention(vq, vk, vv),
                  lambda: paged_prefill.vision_attention_forward(nn.Module(), vq, vk, vv, None)))
    for (n_out, n_in) in ((1376, 512), (4000, 512)):
        layer = nn.Linear(n_in, n_out, bias=False).bfloat16()  # as Llama's MLP and LM head: F.linear's bits
        packed = packed_linear.PackedLinear(layer)
        for m in (1, 16, 512):
            x = torch.randn(m, n_in).bfloat16()
            assert torch.equal(layer(x), packed(x))
            cases.append((f"linear {n_out}x{n_in}, {m} rows", lambda x=x, layer=layer: layer(x),
                          lambda x=x, packed=packed: packed(x)))
    for _ in range(args.rounds):
        for name, before, after in cases:
            record(name + " | before", before)
            record(name + " | after", after)
    print("| op | replaced (ms) | kernel (ms) | speedup |\n|---|---:|---:|---:|")
    for name, _, _ in cases:
        b, a = statistics.median(rows[name + " | before"]), statistics.median(rows[name + " | after"])
        print(f"| {name} | {b:.3f} | {a:.3f} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
