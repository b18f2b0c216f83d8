"""Turns each request's logits into its next token: greedy, temperature, top-k, top-p, per-request seed.

The whole batch is sampled with tensor ops (one sort, one softmax, one cumsum over the sampling rows),
not per-request Python: greedy rows take the argmax, the others an inverse-CDF draw from their
temperature-scaled, top-k and top-p truncated distribution. A seeded request's draw comes from a
counter-based hash of (seed, token index), so the same request gives the same tokens whichever worker
samples which token, whatever else is in the batch (disaggregated and unified agree).
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from mserve.workers.sequence import SamplingParams

_MASK64 = (1 << 64) - 1
CHUNK_ELEMENTS = 2**22  # logits entries the sampling rows are processed in at once


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, token index): splitmix64 of the pair, top 53 bits."""
    z = (seed * 1_000_003 + step + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def truncated_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sampling distribution in descending-logit order: (probs [N, V], order [N, V]).

    logits [N, V] float; temperature [N] > 0; top_k [N] (0: off); top_p [N] in (0, 1] (1: off).
    Top-k keeps the k largest (ties with the k-th included); top-p the smallest prefix whose mass
    reaches top_p, the first token always. The probs are not renormalised (the draw scales by the sum).
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # top_p == 1 is off: float rounding must never drop a token then.
    cut = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))
    return probs.masked_fill(mass_before >= cut[:, None], 0.0), order


def draw(probs: torch.Tensor, order: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the token whose cumulative mass first exceeds u * total."""
    cdf = probs.cumsum(-1)
    target = uniforms[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)
    return order.gather(1, idx).squeeze(1)


def sample(logits: torch.Tensor, params: Seq[SamplingParams], steps: Seq[int],
           generator: torch.Generator | None = None) -> list[int]:
    """logits [N, vocab]; one SamplingParams and output index per row. `generator`: for unseeded rows
    (the global CPU RNG by default)."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    uniforms = torch.rand(len(rows), generator=generator, dtype=torch.float64)
    for j, i in enumerate(rows):
        if params[i].seed is not None:
            uniforms[j] = seeded_uniform(params[i].seed, steps[i])
    # Rows in chunks: the sort, probs and cdf of a chunk stay within about one float32 copy of the
    # logits, what workers/sizing.py budgets for the sampler.
    chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    dev = logits.device
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        sel = [params[i] for i in part]
        probs, order = truncated_probs(
            logits[part].float(), torch.tensor([p.temperature for p in sel], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in sel], device=dev),
            torch.tensor([p.top_p for p in sel], dtype=torch.float32, device=dev))
        # float64 cumsum: the last entries of a float32 cdf can round below the total (never drawn).
        picked = draw(probs.double(), order, uniforms[start:start + chunk].to(dev)).tolist()
        for i, tok in zip(part, picked):
            tokens[i] = tok
    return tokens
