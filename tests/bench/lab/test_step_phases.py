"""lab.step_phases splits a real decode step of a tiny model into phases that add up to the step."""

from __future__ import annotations

from lab.step_phases import PHASES, measure, render


def test_phases_cover_the_step(tiny_model_dirs):
    r = measure(str(tiny_model_dirs["llava"]), batch=2, context=20, steps=3, repeats=1)
    assert set(PHASES) <= set(r)
    # Every phase the decode step runs was timed (the timers were on the real calls), none is negative
    # except "between ops", the remainder, which the timers' own cost can tip either way.
    for phase in PHASES:
        if phase != "between_ops":
            assert r[phase] > 0, phase
    assert abs(sum(r[p] for p in PHASES) - r["step_ms"]) < 1e-6
    assert r["untimed_step_ms"] > 0
    assert "| mlp |" in render([r])
