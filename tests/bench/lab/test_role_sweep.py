"""bench/lab/role_sweep.py: its regimes and its mid-run shift trace (the sweep itself: bench/README.md)."""

import pytest

from lab.role_sweep import BEFORE, SCALED, scaled, shift_trace
from lab.sim.costs import Costs
from mserve.coordinator.role_policy import RolePolicy


def test_scaled_costs_multiply_each_stage_and_leave_the_rest():
    base = Costs.load("cpu-small-llava")
    s = scaled(base)
    assert s.decode_step_s(8, 800) == pytest.approx(base.decode_step_s(8, 800) * SCALED["decode"])
    assert s.prefill_step_s(512, 1) == pytest.approx(base.prefill_step_s(512, 1) * SCALED["prefill"])
    assert s.chunk_tokens == base.chunk_tokens and s.kv_blocks == base.kv_blocks


def test_the_shift_trace_sends_image_prompts_with_short_replies_then_text_with_long_ones():
    reqs = shift_trace(Costs.load("cpu-small-llava"), 10, seed=1, short=16, long=256)
    assert [(r.has_images, r.max_tokens) for r in reqs] == [(True, 16)] * 5 + [(False, 256)] * 5
    assert [r.rid for r in reqs] == list(range(10))


def test_the_sweep_compares_the_defaults_with_the_hand_set_ones_they_replaced():
    assert BEFORE != RolePolicy() and BEFORE.decode_light_seqs == 4
