"""From the coordinator's STATUS (or Redis loads) to a policy observation: hand-made inputs."""

from __future__ import annotations

from mserve.autoscale.policy import SLO
from mserve.autoscale.signals import Signals, fraction_within, histogram_delta, quantile
from mserve.coordinator.telemetry import Telemetry

LE = [0.1, 0.5, 1.0, 2.0]


def hist(counts):
    return {"le": LE, "counts": counts, "sum": 0.0, "count": sum(counts)}


def test_histogram_arithmetic():
    d = histogram_delta(hist([5, 5, 0, 0, 0]), hist([2, 1, 0, 0, 0]))
    assert d["counts"] == [3, 4, 0, 0, 0] and d["count"] == 7
    assert histogram_delta(hist([1, 0, 0, 0, 0]), hist([4, 0, 0, 0, 0]))["count"] == 1  # a restart: from zero
    assert fraction_within(hist([3, 4, 2, 1, 0]), 0.5) == 0.7
    assert fraction_within(hist([3, 4, 2, 1, 0]), 0.7) == 0.7  # 0.5..1.0 straddles 0.7: counted as missed
    assert fraction_within(hist([0, 0, 0, 0, 0]), 1.0) is None
    assert quantile(hist([3, 4, 2, 1, 0]), 0.9) == 1.0
    assert quantile(hist([0, 0, 0, 0, 5]), 0.5) == 2.0  # +Inf bucket: the last finite bound


def worker(role, alive=True, draining=False, **load):
    base = {"queue_len": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, "inflight": 0}
    return {"role": role, "alive": alive, "draining": draining, "load": {**base, **load}}


def status(tel, waiting=None, **workers):
    return {"workers": workers, "telemetry": tel.snapshot(), "waiting": waiting or {}}


def finish(tel, ttft, tpot, images=0):
    tel.on_result({"queue_s": 0.0, "encode_s": 0.2, "prefill_s": 0.3}, arrived=0.0, first_token_at=ttft,
                  now=ttft + tpot * 9, prompt_tokens=10, visual_tokens=0, output_tokens=10, images=images,
                  cache_hits={})


def test_pools_from_status_ready_draining_load_kv_and_parked():
    tel = Telemetry()
    sig = Signals(SLO(ttft_s=1.0, tpot_s=0.1))
    snap = sig.observe(0.0, status(
        tel, waiting={"encode": {"requests": 2, "oldest_s": 3.5}},
        **{"p0": worker("prefill", queue_len=2, running=1, inflight=1),  # reported 3 > in flight 1
           "p1": worker("prefill", inflight=4),  # handed 4 it has not reported yet
           "d0": worker("decode", running=6, free_blocks=20, total_blocks=100),
           "d1": worker("decode", draining=True, running=9, free_blocks=0, total_blocks=100),
           "d2": worker("decode", alive=False, running=50)}))
    o = snap.observation
    assert snap.source == "coordinator"
    assert (o.pools["prefill"].ready, o.pools["prefill"].load) == (2, 7.0)
    dec = o.pools["decode"]
    assert (dec.ready, dec.draining, dec.load, dec.kv_used) == (1, 1, 6.0, 0.8)  # the draining one does not count
    assert (o.pools["encode"].ready, o.pools["encode"].waiting, o.pools["encode"].oldest_wait_s) == (0, 2, 3.5)
    assert snap.ready_ids["decode"] == ["d0"] and snap.draining_ids["decode"] == ["d1"]
    assert o.ttft_attainment is None and o.finished == 0  # first tick: nothing to compare with


def test_slo_attainment_and_images_since_the_last_tick():
    tel = Telemetry()
    sig = Signals(SLO(ttft_s=1.0, tpot_s=0.1))
    for _ in range(4):
        finish(tel, ttft=5.0, tpot=1.0)  # before the first tick: not judged later
    sig.observe(0.0, status(tel, d0=worker("decode")))
    for i in range(10):
        finish(tel, ttft=0.2 if i < 8 else 3.0, tpot=0.05 if i < 5 else 0.5, images=1 if i == 0 else 0)
    o = sig.observe(5.0, status(tel, d0=worker("decode"))).observation
    assert o.finished == 10 and o.ttft_attainment == 0.8 and o.tpot_attainment == 0.5 and o.images_seen
    assert o.pools["prefill"].stage_p90_s == 0.3 and o.pools["encode"].stage_p90_s == 0.2
    o = sig.observe(10.0, status(tel, d0=worker("decode"))).observation
    assert o.finished == 0 and o.ttft_attainment is None and not o.images_seen


def test_redis_fallback_and_nothing_at_all():
    sig = Signals(SLO())
    registry = {"e0": {"role": "encode"}, "d0": {"role": "decode"}, "d1": {"role": "decode"}}
    loads = {"e0": {"queue_len": 3, "running": 1}, "d0": {"running": 2, "free_blocks": 50, "total_blocks": 100},
             "d1": {"running": 1, "draining": 1}}  # Redis keeps booleans as 1 / 0
    snap = sig.observe(0.0, None, registry, loads)
    assert snap.source == "redis" and "Redis loads only" in snap.note
    o = snap.observation
    assert (o.pools["encode"].load, o.pools["decode"].ready, o.pools["decode"].draining) == (4.0, 1, 1)
    assert o.pools["decode"].kv_used == 0.5
    assert sig.observe(0.0, None, None, None).source == "none"


def test_one_models_view_of_a_coordinator_serving_two_counts_only_its_workers_and_parked_requests():
    """One autoscaler per model (--model-name): the other model's busy pools and parked images are not its load."""
    from mserve.autoscale.signals import model_view, model_registry

    a_tel, b_tel = Telemetry(), Telemetry()
    full = {"workers": {"a-d": {**worker("decode", running=9), "model": "a"},
                        "b-d": {**worker("decode", running=1), "model": "b"},
                        "b-p": {**worker("prefill"), "model": "b"}},
            "waiting": {"encode": {"requests": 4, "oldest_s": 2.0}},
            "models": {"a": {"waiting": {"encode": {"requests": 4, "oldest_s": 2.0}}, "telemetry": a_tel.snapshot()},
                       "b": {"waiting": {}, "telemetry": b_tel.snapshot()}}}
    obs = Signals(SLO()).observe(10.0, model_view(full, "b")).observation
    assert obs.pools["decode"].ready == 1 and obs.pools["decode"].load == 1.0
    assert obs.pools["prefill"].ready == 1 and obs.pools["encode"].waiting == 0
    whole = Signals(SLO()).observe(10.0, model_view(full, None)).observation
    assert whole.pools["decode"].ready == 2 and whole.pools["encode"].waiting == 4
    assert model_registry({"a-d": {"model": "a"}, "b-d": {"model": "b"}}, "a") == {"a-d": {"model": "a"}}
