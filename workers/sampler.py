"""Turns each request's logits into its next token: greedy, temperature, top-k, top-p, per-request seed.

A seeded request draws from a generator keyed by (seed, token index), so the same request gives
the same tokens whichever worker samples which token (disaggregated and unified agree).
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from mserve.workers.sequence import SamplingParams


def _generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    logits = logits / params.temperature
    if params.top_k:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    gen = _generator(params.seed, step) if params.seed is not None else None
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def sample(logits: torch.Tensor, params: Seq[SamplingParams], steps: Seq[int]) -> list[int]:
    """logits [N, vocab]; one SamplingParams and output index per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, step) in enumerate(zip(params, steps)):
        if not p.greedy:
            tokens[i] = sample_one(logits[i].float(), p, step)
    return tokens
