"""Pooled shm segments, zero-copy views and in-place allocation in mserve.common.transfer.

Sender and receiver engines share one process here: the receiver still maps the sender's
segments through its own shm_open + mmap, exactly as another process would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing import shared_memory

import pytest
import torch

from mserve.common.transfer import shm_mappings
from mserve.common.transfer.shm_mappings import MappingCache
from mserve.common.transfer.shm_pool import SegmentPool, reap_orphans, size_class
from mserve.common.transfer import TransferEngine, TransferError
from mserve.workers.paged_attention import KVCache

pytestmark = pytest.mark.timeout(60)

MiB = 2**20


def payload(seed: int, nbytes: int = MiB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(nbytes // 8, generator=g), "b": torch.arange(nbytes // 16, dtype=torch.int64)}


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def wait_pending(engine: TransferEngine, want: int = 0, timeout_s: float = 5.0) -> int:
    """The ack is asynchronous: give the sender's thread a moment to process it."""
    deadline = time.monotonic() + timeout_s
    while engine.pending() != want and time.monotonic() < deadline:
        time.sleep(0.002)
    return engine.pending()


def on_disk(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def unlinked(name: str, timeout_s: float = 5.0) -> bool:
    """A sender stops tracking a transfer before its thread unlinks the segment: allow that moment."""
    deadline = time.monotonic() + timeout_s
    while on_disk(name) and time.monotonic() < deadline:
        time.sleep(0.005)
    return not on_disk(name)


@pytest.fixture
def pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    tx, rx = TransferEngine("tx", backend="shm"), TransferEngine("rx")
    yield tx, rx
    tx.close()
    rx.close()


def test_size_classes() -> None:
    assert size_class(1) == 64 * 1024
    assert size_class(8 * MiB) == 8 * MiB
    assert size_class(8 * MiB + 1) == 10 * MiB
    assert size_class(38 * 4 * 16 * 64 * 4 * 16) == 10 * MiB  # one small-model request's KV
    for n in (70_000, 3 * MiB + 5, 100 * MiB - 1):
        assert n <= size_class(n) <= 1.25 * n + 4096 and size_class(n) % 4096 == 0


def test_segments_are_reused_and_bounded(pair: tuple[TransferEngine, TransferEngine]) -> None:
    tx, rx = pair
    names = set()
    for i in range(50):
        want = payload(i, nbytes=MiB * (1 + i % 3))
        desc = tx.publish(f"t{i}", want)
        names.add(desc.shm)
        if i % 2:
            assert same(rx.fetch(desc, timeout_s=10), want)
        else:
            with rx.fetch_view(desc, timeout_s=10) as got:
                assert same(got, want)
        assert wait_pending(tx) == 0
    pool = tx.stats()["shm_pool"]
    assert len(names) == 3 and pool["created"] == 3 and pool["reused"] == 47, pool
    assert pool["retained_bytes"] == sum(size_class(MiB * k) for k in (1, 2, 3))
    assert rx.stats()["shm_mapped"]["attached"] == 3, "the receiver maps each segment once"
    assert all(on_disk(n) for n in names)
    tx.close()
    assert not any(on_disk(n) for n in names), "close() unlinks the pool"


def test_pool_limit_unlinks_idle_and_overflow() -> None:
    with TransferEngine("tx", backend="shm", shm_pool_bytes=3 * MiB) as tx, \
            TransferEngine("rx") as rx:
        small = [tx.publish(f"s{i}", payload(i)) for i in range(2)]  # 2 x 1 MiB, retained
        big = tx.publish("big", payload(9, nbytes=2 * MiB))  # over the bound: a one-off
        assert tx.stats()["shm_pool"]["overflow"] == 1
        for desc, seed in zip(small + [big], (0, 1, 9)):
            assert same(rx.fetch(desc), payload(seed, nbytes=2 * MiB if seed == 9 else MiB))
        assert wait_pending(tx) == 0
        assert unlinked(big.shm), "a one-off segment is unlinked after its use"
        again = tx.publish("big2", payload(9, nbytes=2 * MiB))  # evicts an idle 1 MiB one
        pool = tx.stats()["shm_pool"]
        assert pool["retained_bytes"] <= 3 * MiB and pool["idle"] == 1, pool
        assert sum(on_disk(d.shm) for d in small) == 1
        assert same(rx.fetch(again), payload(9, nbytes=2 * MiB))
    assert not any(on_disk(d.shm) for d in small + [again])


def test_view_blocks_reuse_until_released(pair: tuple[TransferEngine, TransferEngine]) -> None:
    tx, rx = pair
    want = payload(1)
    first = tx.publish("first", want)
    view = rx.fetch_view(first, timeout_s=10)
    assert view.zero_copy and same(view.tensors, want)
    # Held views are the sender's memory: nothing is copied, and the sender may not reuse it.
    assert wait_pending(tx, want=1, timeout_s=0.2) == 1
    second = tx.publish("second", payload(2))
    assert second.shm != first.shm, "a segment under a live view was handed out again"
    assert same(rx.fetch(second), payload(2))
    assert same(view.tensors, want), "the view changed while held"
    view.release()
    view.release()  # idempotent
    assert view.tensors == {}
    assert wait_pending(tx) == 0
    third = tx.publish("third", payload(3))
    assert third.shm in (first.shm, second.shm), "released segments are reused"
    assert (third.shm_gen > first.shm_gen) or third.shm != first.shm
    # fetch(copy=False) is the same view, released by descriptor.
    got = rx.fetch(third, copy=False)
    assert same(got, payload(3)) and rx.stats()["views_open"] == 1
    rx.release_fetched(third)
    assert rx.stats()["views_open"] == 0 and wait_pending(tx) == 0


def test_expiry_under_a_view_unlinks_instead_of_reusing() -> None:
    with TransferEngine("tx", backend="shm", ttl_s=1.0) as tx, TransferEngine("rx") as rx:
        desc = tx.publish("slow", payload(4))
        with rx.fetch_view(desc) as got:
            assert wait_pending(tx) == 0  # expired (after a fresh ttl) while the view is held
            assert unlinked(desc.shm)
            nxt = tx.publish("next", payload(5))
            assert nxt.shm != desc.shm
            assert same(got, payload(4)), "an unlinked segment keeps its bytes for the reader"
        assert tx.stats()["expired"] == 1


def test_views_over_tcp_own_their_memory(pair: tuple[TransferEngine, TransferEngine]) -> None:
    tx, rx = pair
    desc = tx.publish("over-tcp", payload(6), backend="tcp")
    view = rx.fetch_view(desc)
    assert not view.zero_copy
    tensors = view.tensors
    view.release()
    assert same(tensors, payload(6)) and wait_pending(tx) == 0


def test_stale_mapping_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment unlinked and re-created under the same name must not be read through the
    receiver's cached mapping of the old one."""
    monkeypatch.setattr(shm_mappings, "_SWEEP_EVERY_S", 1e9)  # keep the stale mapping cached
    with TransferEngine("rx") as rx:
        with TransferEngine("tx1", backend="shm") as tx1:
            desc = tx1.publish("old", payload(7))
            assert same(rx.fetch(desc), payload(7))
        name = desc.shm
        assert not on_disk(name)
        real = shared_memory.SharedMemory
        monkeypatch.setattr(shared_memory, "SharedMemory",
                            lambda _name, create, size: real(name=name, create=create, size=size))
        with TransferEngine("tx2", backend="shm") as tx2:
            desc2 = tx2.publish("new", payload(8))
            assert desc2.shm == name and desc2.shm_nonce != desc.shm_nonce
            assert same(rx.fetch(desc2), payload(8))
            assert rx.stats()["shm_mapped"]["stale"] == 1


def test_leases_keep_the_sender_off_a_segment() -> None:
    """The receiver-side lease (a shared flock) is what stops reuse, and the header under it is
    what rejects a transfer that is over."""
    pool, cache = SegmentPool(), MappingCache()
    seg = pool.acquire(1000)
    seg.tag("a")
    try:
        _, lease = cache.lease(seg.name, seg.nonce, seg.gen, "a", 1000)
        with pytest.raises(ValueError, match="never published"):
            cache.lease(seg.name, seg.nonce, seg.gen, "not-a", 1000)
        gen = seg.gen
        assert not seg.reclaim(), "reclaimed under a live lease"
        lease.release()
        with pytest.raises(ValueError, match="over"):  # retired by the failed reclaim
            cache.lease(seg.name, seg.nonce, gen, "a", 1000)
        assert seg.reclaim()
        assert pool.recycle(seg) and pool.acquire(1000) is seg
    finally:
        cache.close()
        pool.discard(seg)
        pool.close()
    assert not on_disk(seg.name)


def test_alloc_writes_in_place(pair: tuple[TransferEngine, TransferEngine]) -> None:
    tx, rx = pair
    kv = KVCache(num_layers=2, num_blocks=12, kv_heads=2, block_size=4, head_dim=8)
    for t in kv.k + kv.v:
        t.normal_()
    ids = [7, 1, 4]
    alloc = tx.alloc({"kv": (kv.export_shape(3), kv.dtype), "pos": ((3,), torch.int64)})
    kv.export_blocks(ids, out=alloc.tensors["kv"])
    alloc.tensors["pos"].copy_(torch.tensor(ids))
    desc = tx.publish_allocated("kv", alloc)
    with pytest.raises(ValueError, match="already published"):
        tx.publish_allocated("kv-again", alloc)
    with rx.fetch_view(desc) as got:
        assert torch.equal(got["kv"], kv.export_blocks(ids))
        assert got["pos"].tolist() == ids
        dst = KVCache(num_layers=2, num_blocks=12, kv_heads=2, block_size=4, head_dim=8)
        dst.import_blocks([0, 1, 2], got["kv"])
    assert torch.equal(dst.export_blocks([0, 1, 2]), kv.export_blocks(ids))
    assert wait_pending(tx) == 0
    unused = tx.alloc({"x": ((10,), torch.float32)})  # same size class: the same segment
    assert tx.stats()["shm_pool"]["idle"] == 0
    unused.free()
    assert tx.stats()["shm_pool"] == dict(tx.stats()["shm_pool"], idle=1, created=1, reused=1)
    for backend in ("tcp", "torch"):
        other = tx.alloc({"x": ((5,), torch.float32)}, backend=backend)
        other.tensors["x"].fill_(2.5)
        assert rx.fetch(tx.publish_allocated(f"x-{backend}", other))["x"].tolist() == [2.5] * 5


def test_fetch_errors_keep_working_channels(pair: tuple[TransferEngine, TransferEngine]) -> None:
    tx, rx = pair
    desc = tx.publish("known", payload(9))
    with pytest.raises(TransferError, match="unknown transfer id"):
        rx.fetch(replace(desc, id="never"), timeout_s=5)
    assert same(rx.fetch(desc, timeout_s=5), payload(9))  # same cached socket, right reply


def test_segments_of_a_killed_sender_are_reaped() -> None:
    """kill -9 of a worker's process group takes its resource tracker along: the next pool
    unlinks what the dead process left, and nothing of a live one."""
    code = ("from mserve.common.transfer import TransferEngine; import torch, time\n"
            "tx = TransferEngine('doomed', backend='shm')\n"
            "print(tx.publish('t', {'x': torch.ones(1000)}).shm, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=os.path.dirname(__file__) + "/../..")
    try:
        name = proc.stdout.readline().strip()
        assert on_disk(name)
        with TransferEngine("alive", backend="shm") as alive:
            mine = alive.publish("m", payload(0)).shm
            assert reap_orphans() == 0 and on_disk(name), "the creator is still alive"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            time.sleep(0.2)  # let the killed group's tracker go too
            SegmentPool().close()  # a new pool reaps on start
            assert not on_disk(name) and on_disk(mine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
