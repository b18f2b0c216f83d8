"""When a served greedy sequence counts as Hugging Face's: the one rule every exactness check uses.

float32: token for token, bit-exact. bfloat16 / float16: token for token up to the first step where
HF's own top-2 logits are within that dtype's rounding of each other (twice torch.testing's relative
tolerance for the dtype: RELATIVE_TOLERANCE); there two correct kernels may pick either token, and
what follows that step is another sequence, not compared (vLLM checks its kernels against HF in the
same spirit, more loosely: a differing token must be in the other's top-k). Pure Python: the logits
arrive as floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# Significand bits (with the implicit one) of each reduced-precision dtype: one ulp of x is
# 2 ** (exponent(x) - bits + 1).
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11}
# The relative tolerance torch.testing.assert_close allows a correct kernel in each dtype (its defaults:
# bfloat16 1.6e-2, float16 1e-3). HF's logit and the engine's may each be that far from the exact value,
# so two logits closer than twice it may trade places: that is a tie. Not fitted to our kernels: on the
# shared small-llava (576-token images, the CPU's bf16 prompt and decode kernels, 8 layers) the first
# token that differed from HF bf16's sat at HF gaps of 3-5 ulps (0.19-0.31 at logits near 11), inside
# twice the tolerance (0.35); the tiny checkpoints' at 0-2 ulps.
RELATIVE_TOLERANCE = {"bfloat16": 1.6e-2, "float16": 1e-3}


def ulp(x: float, dtype: str) -> float:
    """One unit in the last place of `x` in `dtype` (0 for float32: ties are not excused there)."""
    bits = SIGNIFICAND_BITS.get(dtype)
    if bits is None:
        return 0.0
    return math.ldexp(1.0, math.frexp(abs(x) or 1e-30)[1] - bits)


def is_tie(top1: float, top2: float, dtype: str) -> bool:
    """Whether HF's two best logits at a step are close enough that a correct kernel in `dtype` may order
    them the other way: within twice that dtype's relative tolerance of the larger (float32: never)."""
    rtol = RELATIVE_TOLERANCE.get(dtype)
    return rtol is not None and top1 - top2 <= 2 * rtol * max(abs(top1), abs(top2))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison: `exact` when every compared step agreed; `compared` steps were
    checked (fewer than the sequence where a tie ended the comparison); where they first differ."""

    exact: bool
    compared: int
    first_difference: int | None = None
    expected: int | None = None
    produced: int | None = None
    tie_at: int | None = None

    def describe(self) -> str:
        if self.exact:
            tail = f", then a bf16 tie at step {self.tie_at}" if self.tie_at is not None else ""
            return f"exact over {self.compared} tokens{tail}"
        return (f"token {self.first_difference} differs: expected {self.expected}, produced {self.produced} "
                f"(HF's top-2 logits there are not a tie)")


def compare_greedy(expected: Sequence[int], produced: Sequence[int], top2: Sequence[tuple[float, float]] | None,
                   dtype: str) -> Verdict:
    """Compare a served greedy sequence with HF generate's.

    `top2[i]` holds HF's two largest logits at step i (needed in reduced precision; None in float32,
    where every token must match). The comparison stops after the first tie: that step's token may go
    either way and the rest of the sequence follows from it."""
    n = min(len(expected), len(produced))
    for i in range(n):
        tie = top2 is not None and i < len(top2) and is_tie(top2[i][0], top2[i][1], dtype)
        if expected[i] != produced[i] and not tie:
            return Verdict(False, i, i, expected[i], produced[i])
        if tie:
            return Verdict(True, i + 1, tie_at=i)
    if len(expected) != len(produced):
        return Verdict(False, n, n, expected[n] if n < len(expected) else None,
                       produced[n] if n < len(produced) else None)
    return Verdict(True, n)
