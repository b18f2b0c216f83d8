"""A decode step's linear layers at 16 rows: weights read from memory, from cache, and merged.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.decode_linears [--rows 16] [--rounds 3]

The peer's `small` llava's 8 decoder layers, each with its 7 bf16 linear layers prepacked as a worker
packs them (q 512, k 256, v 256, o 512 from 512; gate and up 1376 from 512; down 512 from 1376), run on
`--rows` rows (a decode step of 16 requests) the ways a step could meet them:

- `after a flush`: each layer's weights once, after 64 MB of other writes (a step's 46 MB of weights,
  its KV reads and the LM head go through a 32 MB L3 between two uses of a layer);
- `back to back`: the 8 layers again at once (what the L2 and L3 still hold);
- `one layer x 8`: layer 0's weights 8 times (hot in cache: oneDNN's arithmetic at this row count);
- `merged`: q, k, v as one 1024-wide layer and gate, up as one 2752-wide layer, back to back, with a
  check that the merged layer's columns have the separate layers' bits.

Prints ms for the 56 (or 32 merged) calls and their GFLOP/s; read it against `lab.cpu_peak`. Used for
bench/lab/NOTEBOOK.md, "What is left per core".
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = ((512, 512), (256, 512), (256, 512), (512, 512), (1376, 512), (1376, 512), (512, 1376))  # (out, in)


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch import nn

    from mserve.workers import packed_linear

    p = argparse.ArgumentParser(prog="python -m lab.decode_linears", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not packed_linear.available(torch.bfloat16):
        print("this CPU's oneDNN does not prepack bfloat16 linear layers: nothing to time")
        return 0
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def linear(out_f: int, in_f: int, weight: torch.Tensor | None = None) -> packed_linear.PackedLinear:
        layer = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
        if weight is not None:
            layer.weight.data.copy_(weight)
        return packed_linear.PackedLinear(layer)

    plain, merged, same = [], [], True
    x = {n: torch.randn(args.rows, n, dtype=torch.bfloat16) for n in (512, 1376)}
    for _ in range(args.layers):
        weights = [torch.randn(o, i, dtype=torch.bfloat16) * i ** -0.5 for o, i in SHAPES]
        plain.append([linear(o, i, w) for (o, i), w in zip(SHAPES, weights)])
        qkv, gate_up = torch.cat(weights[:3]), torch.cat(weights[4:6])
        merged.append([linear(*qkv.shape, qkv), plain[-1][3], linear(*gate_up.shape, gate_up), plain[-1][6]])
        with torch.inference_mode():
            got = merged[-1][0](x[512]), merged[-1][2](x[512])
            want = torch.cat([lin(x[512]) for lin in plain[-1][:3]], 1), torch.cat([lin(x[512]) for lin in plain[-1][4:6]], 1)
        same = same and all(torch.equal(a, b) for a, b in zip(got, want))
    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    flops = 2 * args.rows * args.layers * sum(o * i for o, i in SHAPES)

    def run(layers) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for layer in layers:
                for lin in layer:
                    lin(x[lin.in_features])
        return (time.perf_counter() - t) * 1e3

    ways = {"after a flush": lambda: (flush.add_(1), run(plain))[1], "back to back": lambda: run(plain),
            f"one layer x {args.layers}": lambda: run([plain[0]] * args.layers), "merged": lambda: run(merged)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        fn()  # warm: oneDNN builds its kernels on first use
    for _ in range(args.rounds):
        for name, fn in ways.items():
            if name == "back to back":
                run(plain)  # the previous way left other weights in the caches
            times[name].append(fn())
    print(f"{args.layers} layers x 7 linear layers at {args.rows} rows, {flops / 1e9:.2f} GFLOP "
          f"(merged: the same columns {'with the same bits' if same else 'WITH OTHER BITS'})")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name}: {ms:.2f} ms, {flops / ms / 1e6:.0f} GFLOP/s (rounds: {', '.join(f'{t:.2f}' for t in ts)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
