"""lab.step_phases splits a real decode step of a tiny model into phases that add up to the step."""

from __future__ import annotations

import pytest

from lab.step_phases import PHASES, measure, render
from mserve.workers import kernels


@pytest.mark.parametrize("kernel", ["kernel", "gather", "bf16-padded"])
def test_phases_cover_the_step(kernel, tiny_model_dirs, monkeypatch):
    if kernel != "gather" and kernels.library() is None:
        pytest.skip("no C compiler: the decode kernel is not built")
    if kernel == "gather":
        monkeypatch.setattr(kernels, "_library", None)
    dtype, attention = ("bfloat16", "padded") if kernel == "bf16-padded" else (None, "auto")
    r = measure(str(tiny_model_dirs["llava"]), batch=2, context=20, steps=3, repeats=1, dtype=dtype,
                attention=attention)
    assert set(PHASES) <= set(r)
    # Every phase the decode step runs was timed (the timers were on the real calls), none is negative
    # except "between ops", the remainder, which the timers' own cost can tip either way. Decode
    # attention is the kernel, or the gather and SDPA it replaces.
    skipped = {"decode_kernel"} if kernel == "gather" else {"kv_gather", "sdpa"}
    for phase in PHASES:
        if phase in skipped:
            assert r[phase] == 0, phase
        elif phase != "between_ops":
            assert r[phase] > 0, phase
    assert abs(sum(r[p] for p in PHASES) - r["step_ms"]) < 1e-6
    assert r["untimed_step_ms"] > 0
    assert "| mlp |" in render([r])
