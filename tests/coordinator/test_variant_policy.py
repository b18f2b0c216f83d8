"""Model-version routing (coordinator/variant_policy.py): group parsing, the decision's thresholds, ties,
missing variants and hysteresis, the per-variant prediction from the machine's own records, and
properties over random loads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mserve.coordinator.routing import WorkerView
from mserve.coordinator.variant_policy import (GroupState, VariantGroup, VariantLoad, VariantRule, choose_variant,
                                               parse_variant_groups, variant_load, variant_rule)
from tests.coordinator.test_request_machine import DISAGG, Harness, make_admitted

LLAVA = VariantGroup("llava", ("llava-small", "llava-large"))
THREE = VariantGroup("q", ("q-s", "q-m", "q-l"))
RULE = VariantRule(ttft_slo_s=1.0, release=0.5, hold_s=2.0)


def loads(**predicted_s: float | None) -> dict[str, VariantLoad]:
    """{variant: load}; keyword names use _ for -, None: no live workers."""
    return {k.replace("_", "-"): VariantLoad(live_workers=0 if v is None else 1, predicted_ttft_s=v or 0.0)
            for k, v in predicted_s.items()}


# -- groups ---------------------------------------------------------------------------------------------

def test_groups_parse_smallest_first_and_refuse_naming_the_setting():
    assert parse_variant_groups("llava=llava-small, llava-large") == {"llava": LLAVA}
    assert parse_variant_groups(" llava=llava-small,llava-large ; q=q-s,q-m,q-l;") == {"llava": LLAVA, "q": THREE}
    assert parse_variant_groups(None) == {} and parse_variant_groups("") == {}
    for bad, match in (("llava", "is not GROUP=SMALL,LARGE"), ("llava=llava-large", "at least two variants"),
                       ("llava=a,,b", "empty variant name"), ("llava=a,b,a", "names a twice"),
                       ("=a,b", "needs a name"), ("llava=llava,b", "cannot be one of its own variants"),
                       ("g=a,b;g=c,d", "group 'g' is defined twice"), ("g=a,b;a=c,d", "a is both a group and a variant")):
        with pytest.raises(ValueError, match=f"^variant_groups: .*{match}"):
            parse_variant_groups(bad)
    with pytest.raises(ValueError, match="^models: "):
        parse_variant_groups("x", setting="models")


def test_the_rule_takes_the_interactive_objective_and_refuses_without_one():
    assert variant_rule({"interactive": 1500.0, "batch": 9000.0}) == VariantRule(ttft_slo_s=1.5)
    with pytest.raises(ValueError, match="--ttft-slo-ms interactive="):
        variant_rule({"batch": 9000.0})
    for kw, match in (({"ttft_slo_s": 0.0}, "ttft_slo_s"), ({"ttft_slo_s": 1.0, "release": 1.5}, "release"),
                      ({"ttft_slo_s": 1.0, "hold_s": -1}, "hold_s")):
        with pytest.raises(ValueError, match=match):
            VariantRule(**kw)


# -- the decision ---------------------------------------------------------------------------------------

def test_interactive_starts_on_the_largest_variant_meeting_the_objective_and_batch_stays_large():
    d = choose_variant(LLAVA, "interactive", loads(llava_small=0.1, llava_large=0.9), RULE, GroupState(), 0.0)
    assert d.variant == "llava-large" and d.state == GroupState("llava-large") and "first interactive" in d.reason
    d = choose_variant(LLAVA, "interactive", loads(llava_small=0.1, llava_large=1.2), RULE, GroupState(), 0.0)
    assert d.variant == "llava-small"
    b = choose_variant(LLAVA, "batch", loads(llava_small=0.1, llava_large=50.0), RULE, GroupState("llava-small"), 0.0)
    assert b.variant == "llava-large" and b.state == GroupState("llava-small")  # batch leaves the state alone
    assert b.reason == "llava: batch stays on the largest live variant llava-large"


def test_interactive_moves_down_only_strictly_above_the_objective():
    on_large = GroupState("llava-large")
    at = choose_variant(LLAVA, "interactive", loads(llava_small=0.1, llava_large=1.0), RULE, on_large, 0.0)
    assert at.variant == "llava-large" and at.state == on_large  # equal to the objective: it holds
    over = choose_variant(LLAVA, "interactive", loads(llava_small=0.1, llava_large=1.001), RULE, on_large, 0.0)
    assert over.variant == "llava-small" and over.state == GroupState("llava-small")
    assert over.reason == "llava: llava-large predicts 1001 ms > objective 1000 ms; interactive down to llava-small (100 ms)"


def test_down_goes_to_the_largest_smaller_variant_meeting_the_objective_else_the_soonest():
    on_l = GroupState("q-l")
    d = choose_variant(THREE, "interactive", loads(q_s=0.1, q_m=0.8, q_l=3.0), RULE, on_l, 0.0)
    assert d.variant == "q-m"
    d = choose_variant(THREE, "interactive", loads(q_s=1.5, q_m=2.0, q_l=3.0), RULE, on_l, 0.0)
    assert d.variant == "q-s"  # nothing meets it: the soonest first token
    d = choose_variant(THREE, "interactive", loads(q_s=2.0, q_m=2.0, q_l=3.0), RULE, on_l, 0.0)
    assert d.variant == "q-m"  # a tie goes to the larger variant
    d = choose_variant(THREE, "interactive", loads(q_s=3.0, q_m=3.0, q_l=3.0), RULE, on_l, 0.0)
    assert d.variant == "q-l" and "no smaller live variant would be sooner" in d.reason
    d = choose_variant(LLAVA, "interactive", loads(llava_small=2.0, llava_large=2.0), RULE, GroupState(), 0.0)
    assert d.variant == "llava-large"  # first decision, nothing meets the objective, a tie: the larger


def test_a_variant_without_live_workers_is_skipped_and_the_reason_says_so():
    d = choose_variant(LLAVA, "batch", loads(llava_small=0.1, llava_large=None), RULE, GroupState(), 0.0)
    assert d.variant == "llava-small" and d.reason.endswith("skipped llava-large (no live workers)")
    d = choose_variant(LLAVA, "interactive", {"llava-small": VariantLoad(1, 0.1)}, RULE, GroupState("llava-large"), 0.0)
    assert d.variant == "llava-small" and d.state == GroupState("llava-small")
    assert "llava-large has no live workers" in d.reason
    none = choose_variant(LLAVA, "interactive", loads(llava_small=None), RULE, GroupState("llava-large"), 0.0)
    assert none.variant is None and none.state == GroupState("llava-large")
    assert none.reason == "llava: no variant has live workers (llava-small, llava-large); waiting"
    with pytest.raises(ValueError, match="unknown latency class 'fast'"):
        choose_variant(LLAVA, "fast", loads(llava_small=0.1), RULE, GroupState(), 0.0)


def test_hysteresis_back_up_only_below_release_held_for_hold_s():
    state = GroupState("llava-small")

    def at(large_s: float, now: float) -> str:
        nonlocal state
        d = choose_variant(LLAVA, "interactive", loads(llava_small=0.2, llava_large=large_s), RULE, state, now)
        state = d.state
        return d.variant

    assert at(0.9, 0.0) == "llava-small"  # under the objective but above release (0.5 s): no move
    assert state.calm_since is None
    assert at(0.5, 1.0) == "llava-small" and state.calm_since is None  # at release: not below it
    assert at(0.4, 2.0) == "llava-small" and state.calm_since == 2.0
    assert at(0.3, 3.9) == "llava-small" and state.calm_since == 2.0  # 1.9 s of 2 s
    assert at(0.6, 4.0) == "llava-small" and state.calm_since is None  # back above release: the hold starts over
    assert at(0.4, 5.0) == "llava-small" and state.calm_since == 5.0
    assert at(0.4, 7.0) == "llava-large" and state == GroupState("llava-large")
    # Load comes back but stays under the objective: no flap down.
    assert at(0.95, 7.5) == "llava-large"
    assert at(1.1, 8.0) == "llava-small"


def test_up_goes_to_the_largest_calm_variant_and_hold_zero_moves_at_once():
    rule = VariantRule(ttft_slo_s=1.0, release=0.5, hold_s=0.0)
    d = choose_variant(THREE, "interactive", loads(q_s=0.1, q_m=0.2, q_l=0.3), rule, GroupState("q-s"), 0.0)
    assert d.variant == "q-l" and d.state == GroupState("q-l")
    d = choose_variant(THREE, "interactive", loads(q_s=0.1, q_m=0.2, q_l=0.7), rule, GroupState("q-s"), 0.0)
    assert d.variant == "q-m"


# -- the prediction -------------------------------------------------------------------------------------

def test_variant_load_predicts_from_the_variants_waiting_requests_and_measured_rates():
    h = Harness(*DISAGG)
    h.t = 1.0
    h.submit(make_admitted("a", images=2, prompt_len=300))
    h.submit(make_admitted("b", prompt_len=100))
    workers = h.m.members.routable()
    for w in workers:
        w.encode_s_per_image, w.tokens_per_s = (0.2, 0.0) if w.role == "encode" else (0.0, 100.0)
    load = variant_load(h.m.requests.values(), workers)
    # 2 images x 0.2 s over 2 encoders + 400 tokens over 2 x 100 tok/s.
    assert load == VariantLoad(live_workers=6, predicted_ttft_s=pytest.approx(0.2 + 2.0))
    assert variant_load([], workers).predicted_ttft_s == 0.0
    unified = [WorkerView("u0", "unified", tokens_per_s=50.0), WorkerView("u1", "unified", tokens_per_s=150.0),
               WorkerView("u2", "unified", alive=False, tokens_per_s=1.0)]
    text_only = [st for st in h.m.requests.values() if not st.admitted.images]
    assert variant_load(text_only, unified) == VariantLoad(live_workers=2, predicted_ttft_s=pytest.approx(0.5))
    assert variant_load([], []) == VariantLoad(live_workers=0, predicted_ttft_s=0.0)


# -- properties -----------------------------------------------------------------------------------------

_PRED = st.one_of(st.none(), st.floats(min_value=0.0, max_value=5.0, allow_nan=False))
_LOADS = st.lists(_PRED, min_size=3, max_size=3).map(
    lambda ps: {v: VariantLoad(0 if p is None else 1, p or 0.0) for v, p in zip(THREE.variants, ps)})
_STATES = st.builds(GroupState, st.sampled_from([None, *THREE.variants]),
                    st.one_of(st.none(), st.floats(min_value=0.0, max_value=10.0)))


@settings(max_examples=300, deadline=None)
@given(_LOADS, _STATES, st.floats(min_value=0.0, max_value=20.0))
def test_batch_takes_the_largest_live_variant_and_every_choice_is_live(loads_, state, now):
    live = [v for v in THREE.variants if loads_[v].live_workers > 0]
    batch = choose_variant(THREE, "batch", loads_, RULE, state, now)
    assert batch.variant == (live[-1] if live else None) and batch.state == state
    d = choose_variant(THREE, "interactive", loads_, RULE, state, now)
    assert (d.variant in live) if live else d.variant is None
    if live:
        assert d.state.interactive == d.variant


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=0.0, max_value=3.0), st.floats(min_value=0.0, max_value=3.0)),
                min_size=1, max_size=40))
def test_interactive_moves_down_only_past_the_objective_and_up_only_after_a_calm_hold(steps):
    state, now, calm_from = GroupState("llava-large"), 0.0, None
    for small_s, large_s in steps:
        now += 0.5
        before = state.interactive
        d = choose_variant(LLAVA, "interactive", loads(llava_small=small_s, llava_large=large_s), RULE, state, now)
        if d.variant == "llava-small" and before == "llava-large":
            assert large_s > RULE.ttft_slo_s and small_s < large_s
        if d.variant == "llava-large" and before == "llava-small":
            assert large_s < RULE.release * RULE.ttft_slo_s
            assert calm_from is not None and now - calm_from >= RULE.hold_s
        calm_from = (calm_from if calm_from is not None else now) if (
            d.variant == "llava-small" and large_s < RULE.release * RULE.ttft_slo_s) else None
        state = d.state
