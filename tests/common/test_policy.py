"""The shared serving rules (common/policy.py): the class order, the KV budget, and every queue agreeing on them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from mserve.common.policy import (DEFAULT_LIMITS, LATENCY_CLASSES, Limits, blocks_for, class_rank, fits_kv,
                                  request_blocks, serving_order)

# (name, priority, latency_class, arrival), listed in the order they must be served.
SERVED_IN_ORDER = [
    ("vip-batch-late", 1, "batch", 9.0),
    ("interactive-early", 0, "interactive", 1.0),
    ("interactive-late", 0, "interactive", 3.0),
    ("batch-early", 0, "batch", 0.0),
    ("batch-late", 0, "batch", 2.0),
    ("low-interactive-first", -1, "interactive", -5.0),
]


def test_priority_comes_before_class_and_class_before_arrival():
    assert serving_order(1, "batch", 9.0) < serving_order(0, "interactive", 0.0)  # priority wins over class
    assert serving_order(0, "interactive", 9.0) < serving_order(0, "batch", 0.0)  # class wins over arrival
    assert serving_order(0, "batch", 1.0) < serving_order(0, "batch", 2.0)  # then the earlier arrival
    assert serving_order(-1, "interactive", -5.0) > serving_order(0, "batch", 100.0)  # negative priority goes last
    shuffled = [SERVED_IN_ORDER[i] for i in (3, 5, 0, 4, 2, 1)]
    assert [n for n, *_ in sorted(shuffled, key=lambda r: serving_order(*r[1:]))] == [n for n, *_ in SERVED_IN_ORDER]


def test_ties_are_equal_keys_so_a_stable_sort_keeps_push_order():
    assert serving_order(2, "batch", 1.5) == serving_order(2, "batch", 1.5)
    assert class_rank(0, "interactive") == class_rank(0, "interactive") < class_rank(0, "batch")
    same = [("c", 0, "batch", 1.0), ("a", 0, "batch", 1.0), ("b", 0, "batch", 1.0)]
    assert [n for n, *_ in sorted(same, key=lambda r: serving_order(*r[1:]))] == ["c", "a", "b"]


def test_class_rank_is_the_order_of_latency_classes_and_refuses_others():
    assert LATENCY_CLASSES == ("interactive", "batch")
    assert class_rank(3, "interactive") == (-3, 0) and class_rank(3, "batch") == (-3, 1)
    with pytest.raises(ValueError):
        class_rank(0, "realtime")  # an unknown class is an error, never silently last


def test_every_class_ordered_queue_serves_in_the_policy_order():
    from mserve.common.protocol.to_worker import EncodeTask, ImageRef
    from mserve.coordinator.records import Stage
    from mserve.coordinator.shedding import choose_shed
    from mserve.coordinator.stage_queues import StageQueues
    from mserve.workers.roles.encode import next_encode_batch

    pushed = [SERVED_IN_ORDER[i] for i in (3, 5, 0, 4, 2, 1)]
    expected = [n for n, *_ in SERVED_IN_ORDER]
    queues = StageQueues(aging_s=1e9)
    for name, priority, latency_class, arrival in pushed:
        queues.push(name, Stage.PREFILL, priority=priority, latency_class=latency_class, since=arrival)
    assert [w.rid for w in queues.ordered(Stage.PREFILL, now=10.0)] == expected
    # The encode queue's arrival is its queue position: push in arrival order.
    by_arrival = sorted(pushed, key=lambda r: r[3])
    tasks = [EncodeTask(request_id=n, attempt=0, images=[ImageRef(hash=n, data=b"x")], priority=p, latency_class=c)
             for n, p, c, _ in by_arrival]
    batch, rest = next_encode_batch(tasks, max_images=len(tasks))
    assert [t.request_id for t in batch] == expected and rest == []
    # Shedding turns away whoever that order serves last; a newcomer no better than it is shed itself.
    waiting = [SimpleNamespace(admitted=SimpleNamespace(request=SimpleNamespace(priority=p, latency_class=c)),
                               arrived=a, name=n) for n, p, c, a in pushed]
    newcomer = SimpleNamespace(priority=0, latency_class="batch")
    assert choose_shed(waiting, newcomer, now=10.0).name == "low-interactive-first"
    assert choose_shed(waiting, SimpleNamespace(priority=-1, latency_class="interactive"), now=10.0) is None


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_counts_a_begun_block_as_taken(tokens: int, blocks: int):
    assert blocks_for(tokens, 16) == blocks


def test_prompt_plus_max_tokens_fits_exactly_up_to_the_last_slot():
    assert request_blocks(10, 6, 16) == 1 and request_blocks(10, 7, 16) == 2
    assert fits_kv(10, 6, num_blocks=1, block_size=16)  # 16 tokens: the one block, full
    assert not fits_kv(10, 7, num_blocks=1, block_size=16)  # 17: one token over
    assert fits_kv(30, 34, num_blocks=4, block_size=16) and not fits_kv(30, 35, num_blocks=4, block_size=16)
    assert fits_kv(0, 0, num_blocks=0, block_size=16) and not fits_kv(1, 0, num_blocks=0, block_size=16)


def test_the_scheduler_refuses_exactly_what_does_not_fit():
    from mserve.workers.block_pool import BlockPool
    from mserve.workers.scheduler import Scheduler
    from mserve.workers.sequence import SamplingParams, Sequence

    scheduler = Scheduler(BlockPool(num_blocks=2, block_size=4))
    scheduler.add(Sequence("fits", [1] * 5, sampling=SamplingParams(max_tokens=3)))  # 8 tokens: 2 blocks
    with pytest.raises(ValueError, match="exceeds the KV pool capacity of 8 tokens"):
        scheduler.add(Sequence("over", [1] * 5, sampling=SamplingParams(max_tokens=4)))  # 9 tokens: 3 blocks
    scheduler.add(Sequence("prefill", [1] * 7, sampling=SamplingParams(max_tokens=99), prefill_only=True))


def test_every_process_takes_its_limit_defaults_from_the_policy(monkeypatch: pytest.MonkeyPatch):
    from mserve.coordinator.admission import Limits as AdmissionLimits
    from mserve.coordinator.settings import CoordinatorSettings
    from mserve.workers.engine import EngineConfig
    from mserve.workers.settings import WorkerSettings

    for f in dataclasses.fields(Limits):
        monkeypatch.delenv(f"MSERVE_{f.name.upper()}", raising=False)
    assert AdmissionLimits is Limits
    assert CoordinatorSettings(model="m").limits() == dataclasses.asdict(DEFAULT_LIMITS)
    worker = WorkerSettings(role="encode", model="m")
    engine = EngineConfig(model_dir="m")
    for name in ("max_image_bytes", "max_image_pixels"):
        assert getattr(worker, name) == getattr(engine, name) == getattr(DEFAULT_LIMITS, name)
    assert DEFAULT_LIMITS.max_image_bytes == 20 * 1024 * 1024 and DEFAULT_LIMITS.max_prompt_tokens == 16384


def test_every_engine_takes_its_budget_defaults_from_the_policy(monkeypatch: pytest.MonkeyPatch):
    import inspect

    from mserve.common.policy import DEFAULT_ENGINE, EngineBudget
    from mserve.coordinator.membership import Membership
    from mserve.workers.block_pool import BlockPool
    from mserve.workers.engine import EngineConfig
    from mserve.workers.scheduler import Scheduler
    from mserve.workers.settings import WorkerSettings
    from mserve.workers.sizing import plan_for_model

    for f in dataclasses.fields(EngineBudget):
        monkeypatch.delenv(f"MSERVE_{f.name.upper()}", raising=False)
    worker = WorkerSettings(role="decode", model="m")
    engine = EngineConfig(model_dir="m")
    scheduler = Scheduler(BlockPool(num_blocks=8, block_size=4))
    sizing = inspect.signature(plan_for_model).parameters
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
        assert getattr(worker, name) == getattr(engine, name) == getattr(DEFAULT_ENGINE, name), name
    assert worker.max_prefill_tokens == DEFAULT_ENGINE.max_prefill_tokens
    assert scheduler.max_num_seqs == DEFAULT_ENGINE.max_num_seqs
    assert engine.reserve_tokens == DEFAULT_ENGINE.reserve_tokens
    assert sizing["block_size"].default == DEFAULT_ENGINE.block_size
    assert Membership().block_size == DEFAULT_ENGINE.block_size
    assert (DEFAULT_ENGINE.block_size, DEFAULT_ENGINE.num_blocks) == (16, 2048)


def test_an_encode_batch_takes_the_best_classes_up_to_its_images_and_keeps_a_request_whole():
    from mserve.common.policy import encode_batch

    # (name, priority, class, images) in arrival order
    queue = [("b1", 0, "batch", 3), ("i1", 0, "interactive", 2), ("p1", 1, "batch", 4), ("i2", 0, "interactive", 1)]
    pick = dict(priority=lambda q: q[1], latency_class=lambda q: q[2], images=lambda q: q[3])
    take, rest = encode_batch(queue, max_images=7, **pick)
    assert [q[0] for q in take] == ["p1", "i1", "i2"]  # 4 + 2 + 1: the batch request waits
    assert [q[0] for q in rest] == ["b1"]
    take, rest = encode_batch(queue, max_images=5, **pick)
    assert [q[0] for q in take] == ["p1"]  # i1 would make 6: stop, never split a request
    take, _ = encode_batch([("big", 0, "batch", 9)], max_images=2, **pick)
    assert [q[0] for q in take] == ["big"]  # more images than the cap: alone, never starved
