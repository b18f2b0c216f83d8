"""Turns each request's logits into its next token: greedy, temperature, top-k, top-p, per-request seed.

The whole batch is sampled with tensor ops (one partial sort, one softmax, one cumsum over the sampling
rows), not per-request Python: greedy rows take the argmax, the others an inverse-CDF draw from their
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
# Candidates a top-p row (without top-k) is drawn from when they hold top_p of its mass (most rows:
# a flatter one is sorted in full).
TOP_P_CANDIDATES = 1024


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, token index): splitmix64 of the pair, top 53 bits."""
    z = (seed * 1_000_003 + step + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def truncated_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's sampling distribution over its `width` largest logits, in descending order:
    (probs [N, width], order [N, width] token ids, complete [N]). `width` 0: rows with neither top-k
    nor top-p, over the whole vocabulary in its own order (no sort).

    logits [N, V] float; temperature [N] > 0; top_k [N] (0: off); top_p [N] in (0, 1] (1: off).
    Top-k keeps the k largest (ties with the k-th included); top-p the smallest prefix whose mass
    reaches top_p, the first token always. The probs are not renormalised (the draw scales by the sum).
    A row is `complete` when its kept tokens all lie within the width (a top-p row whose candidates
    hold less than top_p of the mass is not: sample it again with the full width).
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    if width == 0:  # nothing truncated: the draw needs no order (the vocabulary's own)
        probs = torch.softmax(scaled, dim=-1)
        order = torch.arange(vocab, device=logits.device).expand_as(probs)
        return probs, order, torch.ones(len(probs), dtype=torch.bool, device=logits.device)
    width = vocab if width is None else min(width, vocab)
    if width < vocab:  # a partial sort: the full one is most of the sampler's time on a large vocabulary
        vals, order = torch.topk(scaled, width, dim=-1)
    else:
        vals, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    vals = vals.masked_fill(vals < vals.gather(1, (k - 1)[:, None]), float("-inf"))
    lse = torch.logsumexp(vals, dim=-1)
    if width < vocab:  # a row without top-k normalises over the whole vocabulary, not its candidates
        lse = torch.where(top_k > 0, lse, torch.logsumexp(scaled, dim=-1))
    probs = torch.exp(vals - lse[:, None])
    cumulative = probs.cumsum(-1)
    # top_p == 1 is off: float rounding must never drop a token then.
    cut = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))
    complete = (top_k > 0) | (width == vocab) | (cumulative[:, -1] >= cut)
    return probs.masked_fill(cumulative - probs >= cut[:, None], 0.0), order, complete


def draw(probs: torch.Tensor, order: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the token whose cumulative mass first exceeds u * total. The index
    never passes the row's last token of nonzero probability, so rounding in the float32 cdf (u * total
    rounding up to the total) can never pick a dropped token."""
    cdf = probs.cumsum(-1)
    target = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    last_kept = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)  # the first index of the count's maximum
    idx = torch.minimum(torch.searchsorted(cdf, target, right=True), last_kept)
    return order.gather(1, idx).squeeze(1)


def candidate_width(params: Seq[SamplingParams], vocab: int) -> int:
    """How many of each row's largest logits the rows must sort: their largest top-k, TOP_P_CANDIDATES
    for a top-p row without one; 0 when no row truncates (see `truncated_probs`)."""
    return min(max(p.top_k or (TOP_P_CANDIDATES if p.top_p < 1.0 else 0) for p in params), vocab)


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
    u_of = dict(zip(rows, uniforms.tolist()))
    # Rows in chunks: a chunk's sort, probs and cdf stay within about one float32 copy of the logits,
    # what workers/sizing.py budgets for the sampler.
    vocab = logits.shape[-1]
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    truncating = [i for i in rows if params[i].top_k or params[i].top_p < 1.0]
    plain = [i for i in rows if not (params[i].top_k or params[i].top_p < 1.0)]  # never sorted
    for group in (truncating, plain):
        for start in range(0, len(group), chunk):
            part = group[start:start + chunk]
            for i, tok in _sample_rows(logits, part, params, u_of, candidate_width([params[i] for i in part], vocab)):
                tokens[i] = tok
    return tokens


def _sample_rows(logits: torch.Tensor, part: list[int], params: Seq[SamplingParams], u_of: dict[int, float],
                 width: int) -> list[tuple[int, int]]:
    """(row, token) for rows `part`, over `width` candidates; rows the candidates did not cover, again in full."""
    dev, sel = logits.device, [params[i] for i in part]
    probs, order, complete = truncated_probs(
        logits[part].float(), torch.tensor([p.temperature for p in sel], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in sel], device=dev),
        torch.tensor([p.top_p for p in sel], dtype=torch.float32, device=dev), width)
    picked = draw(probs, order, torch.tensor([u_of[i] for i in part], dtype=torch.float64, device=dev)).tolist()
    done = complete.tolist()
    out = [(i, tok) for i, tok, ok in zip(part, picked, done) if ok]
    redo = [i for i, ok in zip(part, done) if not ok]
    if redo:
        out += _sample_rows(logits, redo, params, u_of, logits.shape[-1])
    return out
