"""Scheduling policy without a model: token budget, chunked prefill, admission, preemption, priority."""

from __future__ import annotations

import pytest

from mserve.workers.block_pool import BlockPool
from mserve.workers.scheduler import Scheduler
from mserve.workers.sequence import SamplingParams, Sequence


def make_seq(rid: str, n_prompt: int, *, max_tokens: int = 4, priority: int = 0) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(1000 * len(rid) + n_prompt, 1000 * len(rid) + 2 * n_prompt)),
                    sampling=SamplingParams(max_tokens=max_tokens), priority=priority)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    """Schedule, pretend the model ran, sample `token` for completing chunks."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed_tokens = c.end
    for c in chunks:
        if c.completes_sequence:
            c.seq.append_token(token)
            if c.seq.finish_reason:
                sched.finish(c.seq, c.seq.finish_reason)
                sched.release_blocks(c.seq)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in chunks]


def test_budget_splits_long_prompt_into_chunks():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=10)
    sched.add(make_seq("a", 25))
    assert run_step(sched) == [("a", 0, 10)]
    assert run_step(sched) == [("a", 10, 10)]
    assert run_step(sched) == [("a", 20, 5)]  # completes: a token is sampled
    assert run_step(sched) == [("a", 25, 1)]  # decode


def test_decode_and_prefill_share_a_step():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=8)
    sched.add(make_seq("a", 6))
    run_step(sched)
    sched.add(make_seq("b", 20))
    assert run_step(sched) == [("a", 6, 1), ("b", 0, 7)]


def test_priority_orders_admission():
    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=4)
    sched.add(make_seq("low", 4))
    sched.add(make_seq("high", 4, priority=5))
    assert run_step(sched)[0][0] == "high"


def test_admission_waits_for_free_blocks():
    pool = BlockPool(6, 4)
    sched = Scheduler(pool, max_num_batched_tokens=100)
    sched.add(make_seq("a", 16, max_tokens=2))
    sched.add(make_seq("b", 12, max_tokens=2))
    assert [r for r, _, _ in run_step(sched)] == ["a"]  # b's 3 blocks do not fit beside a's 4
    while sched.running:
        run_step(sched)
    assert [r for r, _, _ in run_step(sched)] == ["b"]
    pool.check_integrity()


def test_preemption_frees_lowest_priority_and_recomputes():
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, max_num_batched_tokens=100)
    sched.add(make_seq("keep", 7, max_tokens=9, priority=1))
    sched.add(make_seq("vict", 7, max_tokens=9))
    run_step(sched)  # both prefilled: 2 blocks each, pool full
    assert pool.num_free_blocks == 0
    run_step(sched)  # position 7 still fits in each request's second block
    steps = run_step(sched)  # position 8 of `keep` needs a third block: `vict` gives its blocks up
    assert ("keep", 8, 1) in steps and all(r != "vict" for r, _, _ in steps)
    victim = next(s for s in sched.waiting if s.request_id == "vict")
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1 and len(victim.output_ids) == 2
    pool.check_integrity()


def test_request_larger_than_pool_is_rejected_up_front():
    sched = Scheduler(BlockPool(2, 4))
    with pytest.raises(ValueError, match="exceeds the KV pool capacity of 8 tokens"):
        sched.add(make_seq("big", 6, max_tokens=4))


def test_max_num_seqs_caps_the_running_set():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=2)
    for r in "abc":
        sched.add(make_seq(r * 2, 3))
    assert len(run_step(sched)) == 2
