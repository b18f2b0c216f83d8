"""The batch sampler against the per-request loop it replaced (issue #20), in the same process.

`PYTHONPATH=bench .venv/bin/python -m lab.sampler_bench --batch 64 --vocab 32064` times both on
the same logits: all rows greedy, temperature only, top-p only,
temperature + top-p + top-k, and half of the rows seeded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mserve.workers.sampler import sample
from mserve.workers.sequence import SamplingParams


def per_request(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """The sampler before #20: argmax for the batch, then one Python pass per sampled row."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, step) in enumerate(zip(params, steps)):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        gen = None
        if p.seed is not None:
            gen = torch.Generator()
            gen.manual_seed((p.seed * 1_000_003 + step) % (2**63))
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens


def timed(fn, *args, repeat: int) -> float:
    fn(*args)  # warm-up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.sampler_bench", description=__doc__)
    p.add_argument("--batch", type=int, default=64, help="rows sampled together (default 64)")
    p.add_argument("--vocab", type=int, default=32064, help="vocabulary size (default 32064, llava's)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per case; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--logit-scale", type=float, default=3.0,
                   help="logits are N(0, 1) times this (default 3); larger is more peaked, as a trained LM's "
                        "are: flat rows' top-p needs more than the 1024 candidates and sorts in full")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    logits = torch.randn(a.batch, a.vocab, generator=torch.Generator().manual_seed(0)) * a.logit_scale
    steps = list(range(a.batch))
    cases = {
        "greedy": [SamplingParams()] * a.batch,
        "temperature_only": [SamplingParams(temperature=0.8)] * a.batch,
        "top_p_only": [SamplingParams(temperature=0.8, top_p=0.9)] * a.batch,
        "sampled": [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)] * a.batch,
        "sampled_half_seeded": [SamplingParams(temperature=0.8, top_p=0.9, seed=i if i % 2 else None)
                                for i in range(a.batch)],
    }
    rows = {}
    for name, params in cases.items():
        old = timed(per_request, logits, params, steps, repeat=a.repeat)
        new = timed(sample, logits, params, steps, repeat=a.repeat)
        rows[name] = {"per_request_ms": round(old * 1e3, 3), "batched_ms": round(new * 1e3, 3),
                      "speedup": round(old / new, 2)}
    print(json.dumps({"batch": a.batch, "vocab": a.vocab, "logit_scale": a.logit_scale, "threads": a.threads, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
