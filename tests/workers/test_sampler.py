"""The batch sampler: greedy rows are the argmax, sampled rows follow their truncated distribution
(chi-square against the exact one, which a wrong truncation fails), seeded rows repeat whatever the batch."""

from __future__ import annotations

import math

import pytest
import torch

from mserve.workers.sampler import TOP_P_CANDIDATES, sample
from mserve.workers.sequence import SamplingParams

LOGITS = [2.0, 1.5, 1.2, 0.9, 0.3, -0.2, -1.0, -3.0]
DRAWS = 40_000
# chi-square critical values at p = 1e-6 (df 1..7): a right sampler exceeds them once in a million runs.
CRITICAL = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4, 5: 35.9, 6: 38.3, 7: 40.5}


def expected_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The target distribution, written out plainly: scale, keep the top k, softmax, keep the smallest
    prefix reaching top_p, renormalise."""
    scaled = [x / temperature for x in logits]
    ranked = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = ranked[:top_k] if top_k else ranked
    z = sum(math.exp(scaled[i]) for i in keep)
    probs = {i: math.exp(scaled[i]) / z for i in keep}
    kept, mass = [], 0.0
    for i in keep:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(logits))]


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    n = sum(counts)
    if any(c and not p for c, p in zip(counts, probs)):
        return math.inf, 1  # a token the distribution excludes was drawn
    cells = [(c, p * n) for c, p in zip(counts, probs) if p > 0]
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def histogram(tokens: list[int]) -> list[int]:
    return [tokens.count(i) for i in range(len(LOGITS))]


def test_greedy_rows_are_the_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(),
              SamplingParams(temperature=0.5, top_k=3, seed=2), SamplingParams(), SamplingParams(temperature=2.0)]
    tokens = sample(logits, params, [0] * 6)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert all(0 <= t < 50 for t in tokens)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 1.0),
                                                       (1.0, 0, 0.8), (0.6, 6, 0.7), (1.5, 3, 0.95)])
def test_sampled_rows_follow_their_truncated_distribution(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = sample(torch.tensor([LOGITS] * DRAWS), [params] * DRAWS, [0] * DRAWS,
                    generator=torch.Generator().manual_seed(1234))
    counts = histogram(tokens)
    stat, df = chi_square(counts, expected_probs(LOGITS, temperature, top_k, top_p))
    assert stat < CRITICAL[df], (counts, stat)
    # The same test tells a sampler that ignores the truncation (or the temperature) apart.
    wrong = expected_probs(LOGITS, temperature * 1.5, top_k + 1 if top_k else 0, min(1.0, top_p + 0.1))
    assert chi_square(counts, wrong)[0] > 10 * CRITICAL[7]


def test_seeded_rows_repeat_whatever_the_batch_and_follow_the_distribution():
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=7)
    row = torch.tensor([LOGITS])
    alone = [sample(row, [params], [step])[0] for step in range(300)]
    other = SamplingParams(temperature=1.0)
    for step in (0, 17, 299):  # in a batch with other rows, at another position: the same token
        batch = torch.tensor([LOGITS[::-1], LOGITS, LOGITS])
        got = sample(batch, [other, params, SamplingParams()], [5, step, 0])
        assert got[1] == alone[step]
    # Over the token index the seeded draws are the distribution's, and another seed differs.
    steps = list(range(DRAWS))
    tokens = sample(torch.tensor([LOGITS] * DRAWS), [params] * DRAWS, steps)
    stat, df = chi_square(histogram(tokens), expected_probs(LOGITS, 0.9, 6, 0.9))
    assert stat < CRITICAL[df], stat
    assert tokens[:300] == alone
    reseeded = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=8)
    assert sample(torch.tensor([LOGITS] * 300), [reseeded] * 300, list(range(300))) != alone


def test_large_vocab_rows_are_sampled_in_chunks_alike():
    """More rows than one chunk holds: every row still draws from its own distribution."""
    vocab = 2**17  # 32 rows per chunk
    logits = torch.full((80, vocab), -30.0)
    for r in range(80):
        logits[r, r * 7] = 10.0  # each row's mass sits on its own token
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_k=4)] * 80, [0] * 80)
    assert tokens == [r * 7 for r in range(80)]


def test_a_flat_top_p_row_beyond_the_candidates_is_sorted_in_full():
    """top_p of a flat row needs more tokens than TOP_P_CANDIDATES: drawn over its whole kept prefix."""
    vocab, draws = 2 * TOP_P_CANDIDATES, 4000
    row = [-i * 1e-4 for i in range(vocab)]
    probs = expected_probs(row, 1.0, 0, 0.6)
    kept = sum(p > 0 for p in probs)
    assert kept > TOP_P_CANDIDATES  # the case this test is for
    tokens = sample(torch.tensor([row] * draws), [SamplingParams(temperature=1.0, top_p=0.6)] * draws, [0] * draws,
                    generator=torch.Generator().manual_seed(5))
    assert max(tokens) < kept
    bins = 4  # chi-square over 4 equal slices of the kept prefix
    edges = [kept * b // bins for b in range(bins + 1)]
    counts = [sum(edges[b] <= t < edges[b + 1] for t in tokens) for b in range(bins)]
    want = [sum(probs[edges[b]:edges[b + 1]]) for b in range(bins)]
    stat, df = chi_square(counts, want)
    assert stat < CRITICAL[df], (counts, stat)
    assert min(tokens) < TOP_P_CANDIDATES < max(tokens)
