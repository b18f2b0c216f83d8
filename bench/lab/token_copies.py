"""The copies around one attention group of a mixed step: advanced indexing against row copies.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.token_copies [--decode 16] [--chunks 496] [--rounds 3]

A step that carries decode tokens and prompt chunks attends group by group, so each group gathers its
queries out of the step's packed [heads, T, head_dim], gathers its real rows out of the padded output
and scatters them back into the step's output (workers/paged_attention.py). Times those three copies
for the prompt-chunk groups of one layer (the peer's `small` llava: 8 heads of 64, bf16), the way they
were done before (`query[:, index]`, `out[rows]`, `out[dest] = ...`) against `_tokens`,
`index_select` and `index_copy_`, which copy whole token rows, with a check that both give the same
bits. Median us a layer over 200 calls a round. Used for bench/lab/NOTEBOOK.md, "Where a served request's
time goes".
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    import torch

    from mserve.workers.paged_attention import _tokens

    p = argparse.ArgumentParser(prog="python -m lab.token_copies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=16, help="decode tokens in the step (default 16)")
    p.add_argument("--chunks", default="496", help="prompt chunk lengths of one group, comma-separated (default 496)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    heads, d = args.heads, args.head_dim
    lens = [int(n) for n in args.chunks.split(",")]
    g, max_q = len(lens), max(lens)
    index, rows, dest, at = [], [], [], args.decode
    for i, n in enumerate(lens):  # padded query rows repeat the chunk's last token, as AttentionGroup.build
        index.append([at + min(j, n - 1) for j in range(max_q)])
        rows += [i * max_q + j for j in range(n)]
        dest += range(at, at + n)
        at += n
    index, rows, dest = torch.tensor(index), torch.tensor(rows), torch.tensor(dest)
    # the layer's query as HF hands it over: [1, T, heads * d] viewed as [heads, T, d]
    query = torch.randn(1, at, heads * d, dtype=torch.bfloat16).view(1, at, heads, d).transpose(1, 2)[0]
    result = torch.randn(g, max_q, heads, d, dtype=torch.bfloat16)  # what the kernel hands back

    def before():
        q = query[:, index].permute(1, 2, 0, 3).contiguous()
        out = query.new_zeros((at, heads, d))
        out[dest] = result.view(g * max_q, heads, d)[rows]
        return q, out

    def after():
        q = _tokens(query, index.view(-1)).view(g, max_q, heads, d)
        out = query.new_zeros((at, heads, d))
        out.index_copy_(0, dest, result.view(g * max_q, heads, d).index_select(0, rows))
        return q, out

    same = all(torch.equal(a, b) for a, b in zip(before(), after()))
    print(f"step of {args.decode} decode tokens and chunks {lens}: the same bits: {same}")

    def us(fn, calls=200):
        for _ in range(10):
            fn()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6

    for r in range(args.rounds):
        old = statistics.median(us(before) for _ in range(3))
        new = statistics.median(us(after) for _ in range(3))
        print(f"round {r + 1}: advanced indexing {old:.0f} us a layer, row copies {new:.0f} us ({old / new:.2f}x)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
