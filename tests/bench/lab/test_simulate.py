"""The scale model (bench/lab/simulate.py, bench/lab/sim/): pure, fast, no processes."""

from __future__ import annotations

import math

import pytest

from lab.sim.cluster import Cluster
from lab.sim.core import CpuPool, Loop
from lab.sim.costs import COSTS_DIR, Costs
from lab.sim.workload import sim_trace
from lab.simulate import parse_config, simulate
from mserve.coordinator.role_policy import RolePolicy


def make_costs(**over) -> Costs:
    """Small round numbers; every stage and the coordinator on its own processor unless `cores` is set."""
    data = {
        "name": "test",
        "cpu": {"cores": None},
        "network": {"hop_s": 0.0, "backend": "shm"},
        "prompts": {"template_tokens": 10.0, "tokens_per_word": 1.0, "visual_tokens_per_image": 100.0},
        "sizes": {"kv_bytes_per_token": 1000.0, "embedding_bytes_per_visual_token": 100.0},
        "encode": {"batch_s": 0.0, "image_s": 0.01, "per_mpx_s": 0.0, "max_images": 8},
        "prefill": {"step_s": 0.002, "per_token_s": 1e-5, "per_seq_s": 0.0, "chunk_tokens": 512, "max_num_seqs": 64},
        "decode": {"step_s": 0.005, "per_seq_s": 1e-4, "per_ctx_token_s": 0.0, "max_num_seqs": 64,
                   "num_blocks": 100000, "block_size": 16},
        "transfer": {"shm": {"fixed_s": 0.0, "per_byte_s": 0.0}, "kv_handoff": {"shm_per_byte_s": 0.0}},
        "coordinator": {"per_image_request_s": 0.0, "per_text_request_s": 0.0, "per_step_msg_s": 0.0,
                        "per_token_item_s": 0.0, "per_worker_per_s": 0.0, "idle_s_per_s": 0.0},
    }
    for path, value in over.items():
        section, key = path.split("__")
        data[section][key] = value
    return Costs(data)


def trace(costs: Costs, name: str, n: int, seed: int = 0, **kw):
    return sim_trace(name, n, seed, text_tokens=costs.text_tokens(kw.pop("words", 20)),
                     visual_tokens=costs.visual_tokens, **kw)


def test_cpu_pool_shares_cores():
    for cores, expect in ((1.0, 2.0), (2.0, 1.0), (None, 1.0)):
        loop = Loop()
        pool = CpuPool(loop, cores)
        ends = []
        for name in ("a", "b"):
            pool.run(1.0, lambda: ends.append(loop.now), name)
        loop.run()
        assert ends == pytest.approx([expect, expect])
    loop, ends = Loop(), []
    pool = CpuPool(loop, 1.0)
    pool.run(1.0, lambda: ends.append(loop.now), "a")
    loop.at(0.5, lambda: pool.run(0.25, lambda: ends.append(loop.now), "b"))
    loop.run()
    assert ends == pytest.approx([1.0, 1.25])  # b shares from 0.5 to 1.0, a ends at 1.25 - b first
    loop, ends = Loop(), []
    pool = CpuPool(loop, 1.0, contention=1.5)  # oversubscribed: every job 1.5x slower again
    for name in ("a", "b"):
        pool.run(1.0, lambda: ends.append(loop.now), name)
    loop.run()
    assert ends == pytest.approx([3.0, 3.0])


def test_conserves_requests_and_tokens():
    costs = make_costs(cpu__cores=2.0, coordinator__per_image_request_s=0.002, coordinator__per_token_item_s=1e-5)
    reqs = trace(costs, "mixed", 120, rate=40.0, max_tokens=9)
    cluster = Cluster(costs, encode=2, prefill=2, decode=2)
    out = cluster.run(reqs)
    assert len(out) == 120 and sorted(q.r.rid for q in out) == list(range(120))
    assert all(q.tokens == 9 and q.sent_s <= q.first_s <= q.end_s for q in out)
    assert cluster.client.in_flight == 0 and not cluster.client.waiting
    for w in cluster.workers:  # nothing left behind anywhere
        assert not w.inbox and not getattr(w, "queue", []) and not getattr(w, "prompts", [])
        assert not getattr(w, "running", [])
    assert all(v.inflight == 0 and v.inflight_tokens == 0 for c in cluster.coords for v in c.views.values())


@pytest.mark.parametrize("opts, messages", [
    ({}, "every step"),
    ({"stream_via_coordinator": False, "token_report_every": 16}, "every 16th token and the last"),
    ({"stream_via_coordinator": False}, "the last only"),
])
def test_tokens_reach_the_client_whichever_way_the_coordinator_hears_them(opts, messages):
    costs = make_costs(cpu__cores=None)
    reqs = trace(costs, "text", 20, rate=5.0, max_tokens=33)
    cluster = Cluster(costs, encode=1, prefill=1, decode=1, **opts)
    out = cluster.run(reqs)
    assert all(q.tokens == 33 and q.first_s <= q.end_s for q in out)
    # The first token comes with PREFILLED; the decode worker's 32 steps report as `messages` says.
    per_request = {"every step": 32, "every 16th token and the last": 2, "the last only": 1}[messages]
    assert cluster.coords[0].step_items == 20 * per_request


def test_deterministic_per_seed():
    costs = make_costs(cpu__cores=2.0, coordinator__per_text_request_s=0.001)
    runs = [simulate(costs, trace(costs, "mixed", 80, seed=s, rate=30.0, max_tokens=8), encode=1, prefill=2,
                     decode=1, slo_ms={"ttft": 200}) for s in (1, 1, 2)]
    for r in runs:
        r.pop("sim_wall_s")
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_trace_matches_bench_traces():
    from mserve.bench.traces import make_trace

    res = (((64, 64), 1.0), ((96, 64), 2.0))
    for name in ("image", "mixed", "text"):
        real = make_trace(name, 12, seed=5, rate=3.0, photos=False, resolutions=res)
        sim = sim_trace(name, 12, 5, text_tokens=50, visual_tokens=576, rate=3.0, resolutions=res)
        assert [r.arrival_s for r in real] == [s.arrival_s for s in sim]
        assert [[tuple(x) for x in r.image_sizes] for r in real] == [s.image_sizes for s in sim]
        assert [(r.priority, r.latency_class) for r in real] == [(s.priority, s.latency_class) for s in sim]


def test_single_stage_matches_md1():
    """One prefill worker, prompts of exactly one chunk, Poisson arrivals: an M/D/1 queue.
    Mean time to first token = D + rho * D / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    costs = make_costs(prefill__step_s=0.0, prefill__per_token_s=0.01 / 512)  # D = 10 ms per prompt
    d, lam, n = 0.01, 60.0, 12000
    reqs = sim_trace("text", n, 3, text_tokens=512, visual_tokens=0, rate=lam, max_tokens=1)
    s = simulate(costs, reqs, encode=1, prefill=1, decode=1)
    rho = lam * d
    expect_ms = 1e3 * (d + rho * d / (2 * (1 - rho)))
    assert s["ttft_ms"]["mean"] == pytest.approx(expect_ms, rel=0.05)
    assert s["ttft_ms"]["p50"] >= d * 1e3 - 1e-6


def test_throughput_saturates_at_the_bottleneck():
    costs = make_costs(encode__image_s=0.05, encode__max_images=1)  # 20 images/s per encode worker
    reqs = trace(costs, "image", 400, max_tokens=4)
    for encoders in (1, 2):
        s = simulate(costs, reqs, encode=encoders, prefill=2, decode=2, max_concurrency=64)
        assert s["request_throughput"] == pytest.approx(20.0 * encoders, rel=0.03)
        assert s["worker_cpu_per_role"]["encode"] == pytest.approx(1.0, rel=0.03)


def test_shared_cores_cap_throughput():
    """Two busy workers on one core run at half speed: the CPU pool is the bottleneck."""
    costs = make_costs(cpu__cores=1.0, encode__image_s=0.05, encode__max_images=1, decode__step_s=0.0005)
    s = simulate(costs, trace(costs, "image", 200, max_tokens=2), encode=2, prefill=1, decode=1, max_concurrency=64)
    # Two encoders alone would do 40/s; one core gives ~54 ms of CPU per request (50 ms encode, <= 3.3 ms
    # prefill, a share of the decode steps) to every process together: ~18.5/s.
    assert 17.0 < s["request_throughput"] < 20.0


def test_coordinator_ceiling_where_the_per_message_cost_says():
    c_req, per_worker = 0.001, 0.002
    costs = make_costs(coordinator__per_text_request_s=c_req, coordinator__per_worker_per_s=per_worker,
                       prefill__step_s=1e-5, prefill__per_token_s=0.0, decode__step_s=1e-5, decode__per_seq_s=0.0)
    reqs = trace(costs, "text", 3000, max_tokens=2)
    s = simulate(costs, reqs, encode=1, prefill=4, decode=4, max_concurrency=200)
    workers = 9
    ceiling = (1 - per_worker * workers) / c_req  # per_step_msg_s = per_token_item_s = 0 here
    assert s["request_throughput"] == pytest.approx(ceiling, rel=0.03)
    assert s["coordinator_utilisation"] == pytest.approx(1.0, abs=0.03)
    # Two shards double it; an ideal coordinator is limited by the workers only.
    s2 = simulate(costs, reqs, encode=1, prefill=4, decode=4, coordinators=2, max_concurrency=200)
    assert s2["request_throughput"] == pytest.approx(2 * ceiling, rel=0.05)


def test_parse_config():
    assert parse_config("disagg:2e3p4d") == {"encode": 2, "prefill": 3, "decode": 4, "coordinators": 1}
    assert parse_config("disagg:1e1p1d@4c")["coordinators"] == 4
    with pytest.raises(ValueError):
        parse_config("unified:2")


@pytest.mark.parametrize("name", sorted(p.stem for p in COSTS_DIR.glob("*.json")))
def test_committed_cost_files_simulate(name):
    costs = Costs.load(name)
    reqs = trace(costs, "mixed", 30, rate=5.0 if costs.cores else 100.0, max_tokens=8)
    s = simulate(costs, reqs, encode=1, prefill=1, decode=1, slo_ms={"ttft": 2000})
    assert s["completed"] == 30 and not math.isnan(s["ttft_ms"]["p99"])


def test_the_model_lends_prompts_to_decode_workers_as_the_coordinator_does():
    """`local_prefill_tokens` (the coordinator's --local-prefill-tokens, off by default as there): prompts
    waiting behind a busy prefill worker go to the decode worker through route_local_prefill, which
    prefills them in its own steps and decodes on; every request still gets all its tokens."""
    costs = make_costs(prefill__per_token_s=1e-3)  # a 200-token prompt: 0.2 s of prefill, decode steps 5 ms
    reqs = trace(costs, "text", 32, words=200)
    off = simulate(costs, reqs, max_concurrency=16)
    lent = simulate(costs, reqs, max_concurrency=16, local_prefill_tokens=400)
    assert off["prompts_lent"] == 0 and lent["prompts_lent"] > 0
    assert off["completed"] == lent["completed"] == 32
    assert lent["output_throughput"] / lent["request_throughput"] == pytest.approx(
        off["output_throughput"] / off["request_throughput"])  # every request its max_tokens either way
    assert lent["ttft_ms"]["p99"] < 0.8 * off["ttft_ms"]["p99"]


@pytest.mark.parametrize("regime, costs_over", [
    ("prefill-heavy", {"prefill__per_token_s": 1e-3}),  # 0.2 s a prompt, 5 ms decode steps
    ("decode-heavy", {"prefill__per_token_s": 2e-5, "decode__step_s": 0.05, "decode__per_seq_s": 0.005}),
])
def test_adaptive_lending_lends_where_prefill_is_behind_and_not_where_decode_is_busy(regime, costs_over):
    """The coordinator's --adaptive-lending (routing.route_lend_adaptive) in the model: where prompts queue at
    the prefill worker it lends and cuts the tail; where decode is the slower stage it lends little and
    costs at most a few per cent of throughput; every request gets all its tokens either way."""
    costs = make_costs(**costs_over)
    reqs = trace(costs, "text", 32, words=200)
    off = simulate(costs, reqs, max_concurrency=16)
    adaptive = simulate(costs, reqs, max_concurrency=16, adaptive_lending=True)
    assert off["completed"] == adaptive["completed"] == 32
    if regime == "prefill-heavy":
        assert adaptive["prompts_lent"] >= 8 and adaptive["ttft_ms"]["p99"] < 0.8 * off["ttft_ms"]["p99"]
        assert adaptive["request_throughput"] > off["request_throughput"]
    else:
        assert adaptive["prompts_lent"] <= 8  # in the opening burst only, while the decode worker holds little
        assert adaptive["request_throughput"] >= 0.95 * off["request_throughput"]


@pytest.mark.parametrize("regime, costs_over, pools, concurrency, max_tokens, to", [
    ("prefill-heavy", {"prefill__per_token_s": 1e-3}, (1, 2), 16, 16, "prefill"),  # 0.2 s a prompt, 5 ms steps
    ("decode-heavy", {"decode__per_seq_s": 4e-3}, (2, 1), 96, 128, "decode"),  # 0.39 s a step of 96
])
def test_role_switching_moves_a_worker_to_the_slower_stage_and_loses_nothing(regime, costs_over, pools, concurrency,
                                                                              max_tokens, to):
    """bench/lab/sim/roles.py: coordinator/role_policy.py's own `decide` on the model's ticks. The worker of the
    pool with slack drains, reloads and serves the slower stage; every request gets all its tokens, and the
    cluster serves more than with the layout it started from."""
    costs = make_costs(**costs_over)
    reqs = trace(costs, "text", 160, words=200, max_tokens=max_tokens)
    policy = RolePolicy(sustain_s=1.0, cooldown_s=5.0)
    fixed = simulate(costs, reqs, prefill=pools[0], decode=pools[1], max_concurrency=concurrency)
    switched = simulate(costs, reqs, prefill=pools[0], decode=pools[1], max_concurrency=concurrency,
                        role_policy=policy, switch_reload_s=0.5)
    assert fixed["role_switches"] == [] and [role for _, _, role in switched["role_switches"]] == [to]
    assert switched["completed"] == fixed["completed"] == 160
    assert switched["output_throughput"] / switched["request_throughput"] == pytest.approx(max_tokens)
    assert switched["request_throughput"] > 1.2 * fixed["request_throughput"]
