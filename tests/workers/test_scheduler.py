"""Scheduling policy without a model: token budget, chunked prefill, admission, preemption, priority."""

from __future__ import annotations

import pytest

from mserve.workers.block_pool import BlockPool
from mserve.workers.scheduler import Scheduler
from mserve.workers.sequence import SamplingParams, Sequence


def make_seq(rid: str, n_prompt: int, *, max_tokens: int = 4, priority: int = 0,
             latency_class: str = "interactive") -> Sequence:
    base = 1000 * sum(map(ord, rid))  # distinct prompts, so no prefix blocks are shared by accident
    return Sequence(request_id=rid, prompt_ids=list(range(base + n_prompt, base + 2 * n_prompt)),
                    sampling=SamplingParams(max_tokens=max_tokens), priority=priority, latency_class=latency_class)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    """Schedule, pretend the model ran, sample `token` for completing chunks: the engine's step without a model."""
    chunks = sched.schedule()
    sched.postprocess(chunks, [token] * sum(c.completes_sequence for c in chunks))
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
    assert [r for r, _, _ in run_step(sched)] == ["b"]  # shorter first; a's 4 blocks do not fit beside b's 3
    while sched.running:
        run_step(sched)
    assert [r for r, _, _ in run_step(sched)] == ["a"]
    pool.check_integrity()


def test_preemption_frees_lowest_priority_and_recomputes():
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, max_num_batched_tokens=100, reserve_tokens=0)  # admit on the prompt alone
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


def test_prompts_served_by_priority_then_latency_class_then_fewest_tokens():
    sched = Scheduler(BlockPool(256, 4), max_num_batched_tokens=100, clock=FakeClock())
    sched.add(make_seq("batch-short", 3, latency_class="batch"))
    sched.add(make_seq("long", 11))
    sched.add(make_seq("short", 5))
    sched.add(make_seq("high-long", 9, priority=2, latency_class="batch"))
    assert [r for r, _, _ in run_step(sched)] == ["high-long", "short", "long", "batch-short"]
    cut = Scheduler(BlockPool(256, 4), max_num_batched_tokens=12, clock=FakeClock())
    for seq in (make_seq("long", 11), make_seq("short", 5), make_seq("high-long", 9, priority=2)):
        cut.add(seq)
    assert run_step(cut) == [("high-long", 0, 9), ("short", 0, 3)]  # the budget ends inside "short"
    assert run_step(cut) == [("high-long", 9, 1), ("short", 3, 2), ("long", 0, 9)]


def test_aging_lets_a_long_prompt_overtake_newer_short_ones():
    clock = FakeClock()
    sched = Scheduler(BlockPool(256, 4), max_num_batched_tokens=600, max_prefill_tokens=600,
                      aging_tokens_per_s=1000.0, clock=clock)
    sched.add(make_seq("image", 600))
    clock.now = 0.55  # 550 tokens' worth of waiting: ranks as 50 remaining
    sched.add(make_seq("text", 60))
    assert [r for r, _, _ in run_step(sched)] == ["image"]
    fresh = Scheduler(BlockPool(256, 4), max_num_batched_tokens=600, clock=FakeClock())
    fresh.add(make_seq("image", 600))
    fresh.add(make_seq("text", 60))
    assert [r for r, _, _ in run_step(fresh)][0] == "text"  # without the wait, shortest first


def test_a_prompt_queued_past_the_class_aging_time_goes_before_every_class():
    """Batch prompts behind a steady stream of interactive ones: each waits class_aging_s at most."""
    clock = FakeClock()
    sched = Scheduler(BlockPool(256, 4), max_num_batched_tokens=600, max_prefill_tokens=8, class_aging_s=1.0,
                      clock=clock)
    sched.add(make_seq("batch", 8, latency_class="batch"))
    clock.now = 0.9
    sched.add(make_seq("interactive-0", 8))
    assert [r for r, _, _ in run_step(sched)] == ["interactive-0"]  # 0.9 s queued: the class order holds
    clock.now = 1.1
    sched.add(make_seq("interactive-1", 8))
    assert [r for r, _, _ in run_step(sched) if r != "interactive-0"] == ["batch"]  # 1.1 s: before every class
    never = Scheduler(BlockPool(256, 4), max_num_batched_tokens=600, max_prefill_tokens=8, class_aging_s=1e9,
                      clock=(late := FakeClock()))
    never.add(make_seq("batch", 8, latency_class="batch"))
    late.now = 100.0
    never.add(make_seq("interactive", 8))
    assert [r for r, _, _ in run_step(never)] == ["interactive"]


def test_chunk_cap_delays_a_short_prompt_by_at_most_one_chunk():
    sched = Scheduler(BlockPool(512, 4), max_num_batched_tokens=2048, max_prefill_tokens=64, clock=FakeClock())
    sched.add(make_seq("image", 600))
    assert run_step(sched) == [("image", 0, 64)]
    sched.add(make_seq("text", 40))  # arrives while the image prompt is half prefilled
    assert run_step(sched) == [("text", 0, 40), ("image", 64, 24)]
    steps = [run_step(sched) for _ in range(3)]
    assert steps[0][0] == ("text", 40, 1)  # the text request decodes beside every further chunk
    assert all(("image", 0, 0) != c for step in steps for c in step)
    assert all(sum(n for r, _, n in step if r == "image") <= 64 for step in steps)


def test_running_streams_decode_in_every_step_while_prompts_prefill():
    sched = Scheduler(BlockPool(512, 4), max_num_batched_tokens=2048, max_prefill_tokens=32, clock=FakeClock())
    for i in range(3):
        sched.add(make_seq(f"s{i}", 4, max_tokens=50))
    run_step(sched)
    sched.add(make_seq("long", 300))
    for _ in range(8):
        step = run_step(sched)
        assert {r for r, _, n in step if n == 1} >= {"s0", "s1", "s2"}
        assert sum(n for r, _, n in step if r == "long") == 32


def test_prefill_cap_never_exceeds_the_step_budget():
    assert Scheduler(BlockPool(8, 4), max_num_batched_tokens=16, max_prefill_tokens=64).max_prefill_tokens == 16


def test_admission_reserves_room_for_running_requests_next_tokens():
    """Admitting a request the pool cannot carry to its end only buys a preemption and a recompute."""
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, max_num_batched_tokens=100)  # reserve up to 256 tokens a request
    sched.add(make_seq("first", 7, max_tokens=9))
    sched.add(make_seq("second", 7, max_tokens=9))
    assert [r for r, _, _ in run_step(sched)] == ["first"]  # 16 tokens = the whole pool
    while sched.running:
        run_step(sched)
    assert sched.num_preemptions == 0
    assert [r for r, _, _ in run_step(sched)] == ["second"]
    pool.check_integrity()


def test_a_prompt_waits_at_its_first_missing_image_holding_its_blocks_while_others_run():
    from mserve.common.hashing import ImageSpan

    sched = Scheduler(BlockPool(64, 4), max_num_batched_tokens=8)
    seq = make_seq("a", 30)
    seq.images = [ImageSpan(4, 6, "x"), ImageSpan(14, 6, "y")]
    seq.image_embeds = ["x-embeds", None]
    seq.awaiting = {1: [1]}  # image "y" is still encoding elsewhere
    sched.add(seq)
    assert run_step(sched) == [("a", 0, 8)]
    assert run_step(sched) == [("a", 8, 6)]  # stops where "y" starts
    assert run_step(sched) == []  # nothing to do until "y" arrives
    # Admitted: it holds 4 blocks and the 5 more its prompt and next tokens need are reserved, so a
    # request needing 56 of the 60 free blocks is not admitted...
    big = make_seq("big", 220)
    sched.add(big)
    assert run_step(sched) == [] and big in sched.waiting
    sched.waiting.remove(big)
    sched.add(make_seq("b", 3))
    assert run_step(sched) == [("b", 0, 3)]  # ...while one that fits goes ahead of it
    assert run_step(sched) == [("b", 3, 1)]
    seq.awaiting.clear()
    seq.image_embeds[1] = "y-embeds"
    assert run_step(sched) == [("b", 4, 1), ("a", 14, 7)]  # decode first, then the prompt goes on
    assert seq.ready_tokens() == 30
    # Qwen2-VL: 3-D positions wait for every grid: only the text before the first image runs.
    qwen = make_seq("q", 30)
    qwen.images, qwen.image_embeds, qwen.awaiting = [ImageSpan(4, 6, "x")], [None], {0: [0]}
    qwen.positions_pending = True
    assert qwen.ready_tokens() == 4 and qwen.ready_tokens(computed=12) == 12


def test_postprocess_frees_finished_blocks_but_a_prefilled_sequence_keeps_them_until_freed():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool)
    prefill = make_seq("p", 6)
    prefill.prefill_only = True
    sched.add(prefill)
    done = make_seq("d", 5, max_tokens=1)
    sched.add(done)
    run_step(sched)
    assert (prefill.finish_reason, done.finish_reason) == ("prefilled", "length")
    assert not sched.has_unfinished() and sched.sequences() == [prefill] and sched.get("p") is prefill
    assert pool.num_used_blocks == 2  # its KV is still to be exported
    sched.free(prefill)
    assert sched.sequences() == [] and pool.num_used_blocks == 0
    running = make_seq("r", 5)
    sched.add(running)
    run_step(sched)
    sched.abort(running)
    assert running.finish_reason == "abort" and sched.get("r") is None and pool.num_used_blocks == 0
    pool.check_integrity()
