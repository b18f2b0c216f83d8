"""The autoscaling policy alone: hand-made observations, a clock the test moves, decisions checked."""

from __future__ import annotations

import pytest

from mserve.autoscale.policy import (SLO, Observation, PolicyConfig, PolicyState, PoolObservation, PoolPolicy, commit,
                                     decide, default_config)

FAST = dict(up_cooldown_s=10.0, down_cooldown_s=20.0, down_stable_s=5.0, start_timeout_s=60.0)


def config(slo: SLO = SLO(), **pools: PoolPolicy) -> PolicyConfig:
    base = {"encode": PoolPolicy(**FAST), "prefill": PoolPolicy(**FAST),
            "decode": PoolPolicy(scale_up_at=8, scale_down_at=2, kv_up_at=0.85, kv_down_at=0.5, **FAST)}
    base.update(pools)
    return PolicyConfig(pools=base, slo=slo)


def obs(now: float, **pools: PoolObservation | dict) -> Observation:
    full = {p: PoolObservation(ready=1) for p in ("encode", "prefill", "decode")}
    full.update({p: (o if isinstance(o, PoolObservation) else PoolObservation(**o)) for p, o in pools.items()})
    return Observation(now=now, pools=full)


def current(**n: int) -> dict[str, int]:
    return {"encode": 1, "prefill": 1, "decode": 1, **n}


def run(cfg, o, cur, state, apply=True):
    """decide, and commit every change as a runner whose backend succeeded would."""
    out = decide(cfg, o, cur, state)
    if apply:
        for d in out.values():
            commit(state, d, o.now)
    return out


# -- growing ---------------------------------------------------------------------------------------------

def test_load_above_threshold_grows_to_the_needed_count_within_the_step():
    st = PolicyState()
    d = run(config(), obs(0, prefill=dict(ready=1, load=10)), current(), st)["prefill"]
    assert (d.action, d.current, d.desired, d.rule) == ("up", 1, 3, "up")  # ceil(10/4) = 3, step 2
    assert "10 stages" in d.reason and "> 4" in d.reason
    d = run(config(), obs(0, prefill=dict(ready=1, load=40)), current(), PolicyState())["prefill"]
    assert d.desired == 3  # max_step_up 2 caps ceil(40/4) = 10
    d = run(config(), obs(0, prefill=dict(ready=1, load=4.5)), current(), PolicyState())["prefill"]
    assert d.desired == 2  # at least +1


def test_parked_requests_count_as_load():
    d = decide(config(), obs(0, prefill=dict(ready=1, load=2, waiting=5)), current(), PolicyState())["prefill"]
    assert d.action == "up" and "5 parked" in d.reason


def test_up_cooldown_then_grows_again():
    cfg, st = config(), PolicyState()
    assert run(cfg, obs(0, prefill=dict(ready=1, load=9)), current(), st)["prefill"].desired == 3
    d = run(cfg, obs(5, prefill=dict(ready=3, load=30)), current(prefill=3), st)["prefill"]
    assert (d.action, d.rule) == ("hold", "cooldown") and "up cool-down 10s" in d.reason
    d = run(cfg, obs(11, prefill=dict(ready=3, load=30)), current(prefill=3), st)["prefill"]
    assert (d.action, d.desired) == ("up", 5)


def test_holds_while_asked_for_replicas_are_starting_then_gives_up_waiting():
    cfg, st = config(), PolicyState()
    run(cfg, obs(0, decode=dict(ready=1, load=20)), current(), st)
    d = run(cfg, obs(30, decode=dict(ready=1, load=40)), current(decode=3), st)["decode"]
    assert (d.action, d.rule) == ("hold", "starting") and "2 of 3" in d.reason
    d = run(cfg, obs(95, decode=dict(ready=1, load=40)), current(decode=3), st)["decode"]
    assert d.action == "up"  # 65 s short of replicas > start_timeout 60 s: decide on what serves


def test_at_maximum_holds_and_says_why():
    cfg = config(prefill=PoolPolicy(max_replicas=2, **FAST))
    d = decide(cfg, obs(0, prefill=dict(ready=2, load=50)), current(prefill=2), PolicyState())["prefill"]
    assert (d.action, d.rule) == ("hold", "at-max") and "maximum 2" in d.reason


def test_kv_use_grows_decode_even_with_few_sequences():
    d = decide(config(), obs(0, decode=dict(ready=1, load=3, kv_used=0.9)), current(), PolicyState())["decode"]
    assert d.action == "up" and "KV 90% used > 85%" in d.reason


def test_stage_slo_grows_the_slow_stage():
    cfg = config(encode=PoolPolicy(stage_slo_s=0.5, **FAST))
    d = decide(cfg, obs(0, encode=dict(ready=1, load=2, stage_p90_s=1.5)), current(), PolicyState())["encode"]
    assert d.action == "up" and "stage p90 1.5s > 0.5s" in d.reason


# -- SLO attainment ----------------------------------------------------------------------------------------

def slo_obs(now, ttft=None, tpot=None, finished=20, **pools):
    o = obs(now, **pools)
    return Observation(now=now, pools=o.pools, ttft_attainment=ttft, tpot_attainment=tpot, finished=finished)


def test_ttft_miss_grows_the_busier_of_encode_and_prefill_only():
    cfg = config(slo=SLO(ttft_s=1.0, target=0.9))
    # Both between their thresholds (no load rule fires); prefill is relatively busier.
    o = slo_obs(0, ttft=0.5, encode=dict(ready=1, load=1), prefill=dict(ready=1, load=3))
    out = decide(cfg, o, current(), PolicyState())
    assert out["prefill"].action == "up" and "TTFT <= 1s met by 50%" in out["prefill"].reason
    assert out["encode"].action == "hold" and out["decode"].action == "hold"


def test_tpot_miss_grows_decode_when_busy_but_not_when_idle():
    cfg = config(slo=SLO(tpot_s=0.05))
    busy = decide(cfg, slo_obs(0, tpot=0.6, decode=dict(ready=1, load=4)), current(), PolicyState())["decode"]
    assert busy.action == "up" and "TPOT" in busy.reason
    idle = decide(cfg, slo_obs(0, tpot=0.6, decode=dict(ready=1, load=0)), current(), PolicyState())["decode"]
    assert idle.action == "hold"


def test_slo_not_judged_on_too_few_requests():
    cfg = config(slo=SLO(tpot_s=0.05, min_requests=5))
    d = decide(cfg, slo_obs(0, tpot=0.0, finished=3, decode=dict(ready=1, load=4)), current(), PolicyState())
    assert d["decode"].action == "hold"


# -- shrinking and hysteresis ------------------------------------------------------------------------------

def test_shrinks_one_at_a_time_after_the_stable_window():
    cfg, st = config(), PolicyState()
    low = dict(ready=3, load=1)
    d = run(cfg, obs(100, prefill=low), current(prefill=3), st)["prefill"]
    assert (d.action, d.rule) == ("hold", "stabilizing")
    d = run(cfg, obs(103, prefill=low), current(prefill=3), st)["prefill"]
    assert d.rule == "stabilizing" and "3s of the 5s" in d.reason
    d = run(cfg, obs(105, prefill=low), current(prefill=3), st)["prefill"]
    assert (d.action, d.desired, d.rule) == ("down", 2, "down") and "with 2 it would be 0.50" in d.reason
    d = run(cfg, obs(110, prefill=dict(ready=2, load=1)), current(prefill=2), st)["prefill"]
    assert d.rule == "steady"  # 1 stage on 1 replica would not be below 1
    d = run(cfg, obs(118, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"]
    assert d.rule == "stabilizing"
    d = run(cfg, obs(126, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"]
    assert (d.action, d.desired) == ("down", 1)
    d = run(cfg, obs(200, prefill=dict(ready=1, load=0)), current(prefill=1), st)["prefill"]
    assert (d.action, d.rule) == ("hold", "steady") and "floor 1" in d.reason


def test_a_load_spike_resets_the_stable_window():
    cfg, st = config(), PolicyState()
    run(cfg, obs(0, prefill=dict(ready=2, load=0)), current(prefill=2), st)
    run(cfg, obs(3, prefill=dict(ready=2, load=3)), current(prefill=2), st)  # 3/1 >= 1: not low
    d = run(cfg, obs(6, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"]
    assert d.rule == "stabilizing"  # the window started again at 6, not at 0


def test_the_down_test_uses_the_load_after_shrinking_so_it_cannot_flap():
    """Per replica 0.75 is below scale_down_at 1, but with one fewer it would be 1.5: no shrink. And the
    count reached after a growth step does not satisfy the shrink test at the same load."""
    cfg, st = config(), PolicyState()
    d = run(cfg, obs(0, prefill=dict(ready=2, load=1.5)), current(prefill=2), st)["prefill"]
    assert (d.action, d.rule) == ("hold", "steady")
    # Load 5 on one replica -> grow to 2; the same load then holds steady for ever after (no flapping).
    st = PolicyState()
    assert run(cfg, obs(0, prefill=dict(ready=1, load=5)), current(), st)["prefill"].desired == 2
    for t in range(30, 300, 10):
        assert run(cfg, obs(t, prefill=dict(ready=2, load=5)), current(prefill=2), st)["prefill"].action == "hold"


def test_kv_projection_blocks_a_shrink():
    cfg, st = config(), PolicyState()
    o = dict(ready=2, load=1, kv_used=0.3)  # with one replica: 60 % >= kv_down_at 50 %
    for t in (0, 10, 30):
        assert run(cfg, obs(t, decode=o), current(decode=2), st)["decode"].action == "hold"


def test_down_cooldown_after_growth():
    cfg, st = config(), PolicyState()
    run(cfg, obs(0, prefill=dict(ready=1, load=5)), current(), st)
    d = run(cfg, obs(6, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"]
    assert d.rule == "stabilizing"
    d = run(cfg, obs(12, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"]
    assert (d.action, d.rule) == ("hold", "cooldown") and "down cool-down 20s" in d.reason
    assert run(cfg, obs(21, prefill=dict(ready=2, load=0)), current(prefill=2), st)["prefill"].action == "down"


# -- bounds, zero ------------------------------------------------------------------------------------------

def test_bounds_apply_at_once_whatever_the_cooldown():
    cfg = config(decode=PoolPolicy(min_replicas=2, max_replicas=3, scale_up_at=8, scale_down_at=2, **FAST))
    st = PolicyState()
    commit(st, run(cfg, obs(0, prefill=dict(ready=1, load=9)), current(), st)["prefill"], 0)
    out = decide(cfg, obs(1, decode=dict(ready=1)), current(decode=1), st)
    assert (out["decode"].desired, out["decode"].rule) == (2, "min")
    out = decide(cfg, obs(1, decode=dict(ready=5)), current(decode=5), st)
    assert (out["decode"].desired, out["decode"].rule) == (3, "max")


def test_encoders_go_to_zero_without_images_and_come_back_for_a_parked_image():
    cfg = config(encode=PoolPolicy(min_replicas=0, idle_to_zero_s=60, **FAST))
    st = PolicyState()
    run(cfg, Observation(now=0, pools=obs(0, encode=dict(ready=1, load=1)).pools, images_seen=True), current(), st)
    d = run(cfg, obs(30, encode=dict(ready=1)), current(), st)["encode"]
    assert (d.action, d.rule) == ("hold", "steady") and "scales to zero after 60s" in d.reason
    d = run(cfg, obs(61, encode=dict(ready=1)), current(), st)["encode"]
    assert (d.desired, d.rule) == (0, "to-zero") and "no image request for 61s" in d.reason
    d = run(cfg, obs(70, encode=dict(ready=0)), current(encode=0), st)["encode"]
    assert (d.action, d.rule) == ("hold", "zero")
    # An image arrives: parked at the coordinator for want of an encoder -> one starts, cool-down or not.
    d = run(cfg, obs(71, encode=dict(ready=0, waiting=1, oldest_wait_s=0.4)), current(encode=0), st)["encode"]
    assert (d.desired, d.rule) == (1, "from-zero") and "1 request(s) parked" in d.reason
    d = run(cfg, obs(72, encode=dict(ready=0, waiting=1)), current(encode=1), st)["encode"]
    assert d.rule == "starting"
    # Serving again; images keep it up.
    d = run(cfg, Observation(now=100, pools=obs(100, encode=dict(ready=1)).pools, images_seen=True), current(), st)
    assert d["encode"].action == "hold"
    assert run(cfg, obs(150, encode=dict(ready=1)), current(), st)["encode"].action == "hold"  # 50 s idle < 60


def test_encoders_above_one_shrink_by_the_load_rule_never_straight_to_zero():
    cfg = config(encode=PoolPolicy(min_replicas=0, idle_to_zero_s=1, **FAST))
    st = PolicyState()
    for t in (0, 10):
        d = run(cfg, obs(t, encode=dict(ready=2)), current(encode=2), st)["encode"]
    assert (d.desired, d.rule) == (1, "down")


def test_default_config_and_validation():
    cfg = default_config()
    assert cfg.pools["decode"].kv_up_at == 0.85 and cfg.pools["encode"].scale_up_at == 4
    with pytest.raises(ValueError, match="hysteresis"):
        PoolPolicy(scale_up_at=2, scale_down_at=2)
    with pytest.raises(ValueError, match="min <= max"):
        PoolPolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="idle_to_zero_s needs min_replicas 0"):
        PoolPolicy(idle_to_zero_s=10)
    with pytest.raises(ValueError, match="KV"):
        PoolPolicy(kv_up_at=0.5, kv_down_at=0.6)


def test_decisions_read_as_sentences():
    d = decide(config(), obs(0, decode=dict(ready=1, load=20)), current(), PolicyState())["decode"]
    assert str(d).startswith("decode: 1 -> 3 (up): load 20 sequences = 20.00 per replica > 8")
    h = decide(config(), obs(0), current(), PolicyState())["prefill"]
    assert str(h).startswith("prefill: hold at 1 (steady): load 0 stages")
