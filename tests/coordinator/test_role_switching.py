"""Role switching without processes: the policy's decision (pure), and the request machine's switch
(SWITCH_ROLE out, routed nothing new, SHUTDOWN once drained, back with the new role; a death mid-switch).
The cluster test is tests/coordinator/test_cluster_role_switch.py."""

from __future__ import annotations

import pytest

from mserve.common.protocol import MsgType
from mserve.common.protocol.to_worker import SWITCHABLE_ROLES
from mserve.coordinator.role_policy import DECODE_HEAVY, PREFILL_HEAVY, RoleMemory, RolePolicy, decide
from mserve.coordinator.routing import WorkerView
from mserve.status import build_report, format_report
from mserve.switch_role import SWITCHABLE
from tests.coordinator.test_request_machine import CLIENT, DEAD_AFTER, Harness, kinds, make_admitted, only

POLICY = RolePolicy(prefill_heavy_tokens=1000, prefill_light_tokens=100, decode_heavy_seqs=10, decode_light_seqs=2,
                    sustain_s=5.0, cooldown_s=30.0)


def prefill(wid: str, tokens: int) -> WorkerView:
    return WorkerView(wid, "prefill", inflight=1 if tokens else 0, inflight_tokens=tokens)


def decode(wid: str, seqs: int, running: int = 0) -> WorkerView:
    return WorkerView(wid, "decode", inflight=seqs, running=running)


def run_policy(workers, queued_tokens=0, queued_decodes=0, *, at=(0.0, 2.0, 4.0, 6.0), memory=RoleMemory(),
               switching=0):
    """The policy called at each time in `at`, as the ticks do: (the decisions, the last memory)."""
    decisions = []
    for now in at:
        d, memory = decide(workers, queued_tokens, queued_decodes, switching, memory, now, POLICY)
        decisions.append(d)
    return decisions, memory


def test_prefill_heavy_moves_the_least_busy_decode_worker_to_prefill_once_the_regime_held():
    workers = [prefill("p0", 3000), decode("d0", 2), decode("d1", 1), decode("d2", 0, running=1)]
    decisions, memory = run_policy(workers, queued_tokens=500)
    assert decisions[:3] == [None, None, None]  # held 0, 2, 4 s: under sustain_s
    d = decisions[3]
    assert (d.worker_id, d.role) == ("d1", "prefill")  # d1 and d2 hold one sequence each: the first by id
    assert "prefill-heavy" in d.reason
    assert memory.last_switch == 6.0


def test_decode_heavy_moves_the_prefill_worker_with_the_least_backlog_to_decode():
    workers = [prefill("p0", 80), prefill("p1", 20), decode("d0", 15), decode("d1", 9, running=12)]
    decisions, _ = run_policy(workers, queued_decodes=2)
    assert decisions[:3] == [None, None, None]
    assert (decisions[3].worker_id, decisions[3].role) == ("p1", "decode")
    assert "decode-heavy" in decisions[3].reason


def test_between_the_thresholds_or_with_both_pools_busy_nothing_switches():
    middle = [prefill("p0", 500), decode("d0", 1), decode("d1", 1)]  # backlog over light, under heavy
    both = [prefill("p0", 5000), prefill("p1", 5000), decode("d0", 30), decode("d1", 30)]
    for workers in (middle, both):
        decisions, memory = run_policy(workers, at=[float(t) for t in range(20)])
        assert decisions == [None] * 20 and memory.regime is None


def test_a_break_in_the_regime_restarts_its_clock():
    heavy = [prefill("p0", 3000), decode("d0", 0), decode("d1", 0)]
    calm = [prefill("p0", 10), decode("d0", 0), decode("d1", 0)]
    _, memory = run_policy(heavy, at=(0.0, 4.0))
    assert memory.regime == PREFILL_HEAVY
    d, memory = decide(calm, 0, 0, 0, memory, 4.5, POLICY)  # one calm look
    assert d is None and memory.regime is None
    decisions, _ = run_policy(heavy, at=(5.0, 9.0, 10.0), memory=memory)
    assert decisions[:2] == [None, None] and decisions[2] is not None  # 5 s from 5.0, not from 0.0


def test_cooldown_and_a_switch_under_way_hold_the_next_one_back():
    heavy = [prefill("p0", 3000), decode("d0", 0), decode("d1", 0), decode("d2", 0)]
    decisions, memory = run_policy(heavy)
    assert decisions[3] is not None
    # The same regime goes on: not before the cooldown (30 s from 6.0), and then only once it held again.
    later, memory = run_policy(heavy, at=[6.0 + t for t in range(1, 36)], memory=memory)
    assert [i for i, d in enumerate(later) if d is not None] == [29]  # at 36.0: 30 s since the last switch
    blocked, _ = run_policy(heavy, at=(100.0, 110.0), memory=RoleMemory(), switching=1)
    assert blocked == [None, None]


@pytest.mark.parametrize("workers", [
    [prefill("p0", 9000), decode("d0", 0)],  # prefill-heavy, but d0 is the only decode worker
    [prefill("p0", 0), decode("d0", 50), decode("d1", 50)],  # decode-heavy, but p0 is the only prefill worker
    [WorkerView("u0", "unified", inflight_tokens=9000), decode("d0", 0), decode("d1", 0)],  # no prefill pool
])
def test_the_last_worker_of_a_pool_is_never_switched_away(workers):
    decisions, memory = run_policy(workers, at=[float(t) for t in range(0, 60, 2)])
    assert decisions == [None] * 30


def test_the_regimes_are_named_as_the_docs_name_them():
    assert (PREFILL_HEAVY, DECODE_HEAVY) == ("prefill-heavy", "decode-heavy")
    assert SWITCHABLE == SWITCHABLE_ROLES  # mserve switch-role's choices are the wire's


# -- the defaults, in the regimes the scale model showed (bench/lab/role_sweep.py, 32 requests in flight) -------
@pytest.mark.parametrize("workers, to", [
    # A wrong 1e1p2d start under image prompts: ~17 k prompt tokens queued at the prefill worker, 3 sequences a
    # decode worker; and under the mixed trace, 4-8 a decode worker (the hand-set decode_light_seqs 4 held there).
    ([prefill("p0", 17394), decode("d0", 3), decode("d1", 3)], "prefill"),
    ([prefill("p0", 8360), decode("d0", 8), decode("d1", 3)], "prefill"),
    # The shift trace's decode-heavy half from 1e2p1d: one decode worker holds all 32, no prompt queued.
    ([prefill("p0", 0), prefill("p1", 0), decode("d0", 32)], "decode"),
])
def test_the_default_thresholds_move_a_worker_where_the_model_gained(workers, to):
    policy = RolePolicy()
    memory, decisions = RoleMemory(), []
    for now in (0.0, policy.sustain_s / 2, policy.sustain_s):
        d, memory = decide(workers, 0, 0, 0, memory, now, policy)
        decisions.append(d)
    assert decisions[:2] == [None, None] and decisions[2] is not None and decisions[2].role == to


@pytest.mark.parametrize("workers", [
    [prefill("p0", 669), prefill("p1", 669), decode("d0", 30)],  # 1e2p1d, decode-heavy image: prompts still queue
    [prefill("p0", 4804), prefill("p1", 4804), decode("d0", 13)],  # 1e2p1d, prefill-heavy mixed: decode not light
])
def test_the_default_thresholds_hold_where_no_layout_was_better(workers):
    policy, memory = RolePolicy(), RoleMemory()
    for now in range(0, 120, 1):
        d, memory = decide(workers, 0, 0, 0, memory, float(now), policy)
        assert d is None


def test_a_decode_worker_given_away_at_the_light_edge_leaves_the_others_under_decode_heavy():
    """Two decode workers at decode_light_seqs each: after one leaves, the other holds twice that, and must not be
    decode-heavy at once (no switch straight back)."""
    policy = RolePolicy()
    after = [prefill("p0", 0), prefill("p1", 0), decode("d0", 2 * policy.decode_light_seqs)]
    memory = RoleMemory()
    for now in range(0, 60, 1):
        d, memory = decide(after, 0, 0, 0, memory, float(now), policy)
        assert d is None


# -- the request machine ----------------------------------------------------------------------------------

def test_a_switch_drains_the_worker_then_it_serves_its_new_role():
    h = Harness(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    pre = only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")
    dec = only(h.prefilled("p0", pre, 7), MsgType.DECODE)
    victim, other = dec.worker_id, ({"d0", "d1"} - {dec.worker_id}).pop()
    assert h.m.switcher.refusal(victim, "encode") is not None
    assert h.m.switcher.refusal("p0", "decode") == ("worker_id 'p0': the last prefill worker of a pipeline with no "
                                                    "other way to serve (a prefill and a decode worker, or a unified "
                                                    "one, must stay)")
    assert h.m.switcher.refusal(victim, "decode") == f"role 'decode': worker {victim!r} already has that role"
    assert h.m.switcher.refusal(victim, "prefill") is None
    out = h.m.switch_role(victim, "prefill", "operator", now=h.t)
    assert kinds(out) == [("SWITCH_ROLE", victim)] and out[0].body["role"] == "prefill"
    status = h.m.status()
    assert status["workers"][victim]["switching"] == "decode->prefill (draining)"
    assert status["role_switching"]["switching"][victim]["phase"] == "draining"
    assert h.m.switcher.refusal(victim, "unified") == f"worker_id {victim!r}: already switching to prefill"
    # Nothing new goes to it, though its heartbeat does not say "draining" yet.
    h.worker(victim, MsgType.HEARTBEAT, worker_id=victim, load={"draining": False})
    pre_b = only(h.submit(make_admitted("b")), MsgType.PREFILL, "p0")
    assert only(h.prefilled("p0", pre_b, 8), MsgType.DECODE).worker_id == other
    assert h.advance(0.2, beating=("p0", "d0", "d1")) == []  # "a" still decodes there: no SHUTDOWN
    assert kinds(h.step(victim, dec, [9], finished=True)) == [("RESULT", CLIENT)]
    assert kinds(h.advance(0.2, beating=("p0", "d0", "d1"))) == [("SHUTDOWN", victim)]
    h.worker(victim, MsgType.BYE, worker_id=victim, switching_to="prefill")
    assert h.m.status()["workers"][victim]["switching"] == "decode->prefill (reloading)"
    report = build_report("tcp://127.0.0.1:5555", h.m.status(), None, None, None, "unset", now=0.0)
    assert f"{victim}  decode   switching decode->prefill (reloading)" in format_report(report)  # `mserve status`
    assert report["coordinator"]["role_switching"]["switching"][victim]["phase"] == "reloading"  # ... --json
    h.advance(DEAD_AFTER * 2, beating=("p0", other))  # reloading takes a while: the switch waits
    assert victim in h.m.switcher.switching
    h.join(victim, "prefill")
    status = h.m.status()
    assert status["workers"][victim]["role"] == "prefill" and "switching" not in status["workers"][victim]
    assert status["role_switching"]["completed"] == 1 and status["roles"] == {"prefill": 2, "decode": 1}


def test_a_worker_killed_while_switching_has_its_work_rerun_and_the_switch_dropped():
    h = Harness(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    pre = only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")
    dec = only(h.prefilled("p0", pre, 7), MsgType.DECODE)
    victim, other = dec.worker_id, ({"d0", "d1"} - {dec.worker_id}).pop()
    h.m.switch_role(victim, "prefill", "operator", now=h.t)
    out = h.advance(DEAD_AFTER * 2, beating=("p0", other))  # kill -9: its heartbeats stop
    rerun = only(out, MsgType.PREFILL, "p0")  # "a" runs again from its start (its tokens kept)
    assert rerun.body["attempt"] == 1
    status = h.m.status()
    assert status["role_switching"]["switching"] == {} and status["role_switching"]["dropped"] == 1
    assert status["workers"][victim]["alive"] is False


def test_the_policy_switches_a_worker_on_the_ticks_when_enabled():
    h = Harness(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), role_switching=True)
    h.m.switcher.policy = RolePolicy(prefill_heavy_tokens=100, sustain_s=1.0)
    for i in range(8):  # prompts pile up at p0 (it never answers); d0 and d1 idle
        h.submit(make_admitted(f"r{i}", prompt_len=40))
    out = h.advance(1.5, beating=("p0", "d0", "d1"))
    # d0 holds nothing: released in the same tick, after the SWITCH_ROLE (one ordered link)
    assert kinds(out) == [("SWITCH_ROLE", "d0"), ("SHUTDOWN", "d0")] and out[0].body["role"] == "prefill"
    assert h.m.status()["role_switching"]["switching"]["d0"]["reason"].startswith("auto: prefill-heavy")
    off = Harness(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    off.m.switcher.policy = h.m.switcher.policy
    for i in range(8):
        off.submit(make_admitted(f"r{i}", prompt_len=40))
    assert off.advance(3.0, beating=("p0", "d0", "d1")) == []  # off by default


# -- the worker's side: which SWITCH_ROLE it takes, and SIGTERM during a switch (bookkeeping only, no model) ---

def bare_worker(role: str):
    from mserve.workers.draining import Drain
    from mserve.workers.worker import Worker

    w = object.__new__(Worker)  # the flags begin_switch and begin_drain read and set; nothing loaded
    w.role, w.worker_id, w.drain, w.switch_to, w.running = role, f"{role}-0", Drain(25.0), None, True
    return w


@pytest.mark.parametrize("role, to, named, takes", [
    ("decode", "prefill", "decode-0", True), ("prefill", "unified", "prefill-0", True),
    ("decode", "decode", "decode-0", False),  # its own role
    ("encode", "prefill", "encode-0", False),  # encode workers do not switch
    ("decode", "prefill", "decode-9", False),  # meant for another worker
])
def test_a_worker_drains_for_a_switch_it_can_make_and_ignores_the_others(role, to, named, takes):
    from mserve.common.protocol.to_worker import SwitchRole

    w = bare_worker(role)
    w.begin_switch(SwitchRole(worker_id=named, role=to))
    assert (w.switch_to, w.drain.active) == ((to, True) if takes else (None, False))


def test_sigterm_during_a_switch_cancels_it_and_the_drain_ends_in_an_exit():
    from mserve.common.protocol.to_worker import SwitchRole

    w = bare_worker("decode")
    w.begin_switch(SwitchRole(worker_id="decode-0", role="prefill"))
    w.begin_drain()  # SIGTERM: no switch any more, still draining, still running
    assert (w.switch_to, w.drain.active, w.running) == (None, True, True)
    w.begin_switch(SwitchRole(worker_id="decode-0", role="prefill"))  # a switch asked while draining: ignored
    assert w.switch_to is None
    w.begin_drain()  # a second SIGTERM: stop now
    assert w.running is False
