"""The host-wide (L2) embedding store: whole entries or none, bounded LRU, shared across instances."""

from __future__ import annotations

import os

import pytest
import torch

from mserve.common.transfer.host_store import HostEmbeddingStore


def emb(rows: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_round_trip_and_sharing_between_instances(tmp_path):
    a = HostEmbeddingStore(str(tmp_path), "model-x", 1 << 20)
    b = HostEmbeddingStore(str(tmp_path), "model-x", 1 << 20)  # another worker on the host
    other = HostEmbeddingStore(str(tmp_path), "model-y", 1 << 20)
    a.put("img1", emb(5, 1), (1, 2, 3))
    a.put("img2", emb(4, 2, torch.bfloat16))
    got = b.get("img1")
    assert got is not None and torch.equal(got.embeds, emb(5, 1)) and got.grid_thw == (1, 2, 3)
    got2 = b.get("img2")
    assert got2.embeds.dtype == torch.bfloat16 and torch.equal(got2.embeds, emb(4, 2, torch.bfloat16))
    assert got2.grid_thw is None
    assert other.get("img1") is None  # another model's namespace never reads it
    assert sorted(b.keys()) == ["img1", "img2"]


def test_bounded_by_bytes_least_recently_used_first(tmp_path):
    entry = 64 + 10 * 8 * 4
    store = HostEmbeddingStore(str(tmp_path), "m", 3 * entry)
    for i in range(3):
        assert store.put(f"k{i}", emb(10, i)) == []
        os.utime(os.path.join(store.dir, f"k{i}.emb"), ns=(i * 10**9, i * 10**9))  # a clear age order
    assert store.get("k0") is not None  # a hit makes k0 the most recent
    assert store.put("k3", emb(10, 3)) == ["k1"]
    assert sorted(store.keys()) == ["k0", "k2", "k3"] and store.used_bytes() == 3 * entry
    assert store.put("huge", emb(1000, 9)) == [] and store.get("huge") is None  # over the whole bound


def test_a_bad_file_is_a_miss_and_zero_capacity_disables(tmp_path):
    store = HostEmbeddingStore(str(tmp_path), "m", 1 << 20)
    store.put("k", emb(3, 0))
    path = os.path.join(store.dir, "k.emb")
    with open(path, "r+b") as f:
        f.truncate(100)
    assert store.get("k") is None
    with open(path, "wb") as f:
        f.write(b"not an embedding" * 8)
    assert store.get("k") is None
    off = HostEmbeddingStore(str(tmp_path), "m2", 0)
    assert not off.enabled and off.put("k", emb(3, 0)) == [] and off.get("k") is None
    with pytest.raises(ValueError):
        store.get("../escape")


def test_stale_temporaries_of_a_dead_writer_are_removed(tmp_path):
    store = HostEmbeddingStore(str(tmp_path), "m", 1 << 20)
    tmp = os.path.join(store.dir, ".tmp-999999-dead")
    with open(tmp, "wb") as f:
        f.write(b"x" * 100)
    os.utime(tmp, ns=(0, 0))
    store.put("k", emb(2, 0))
    assert not os.path.exists(tmp) and store.keys() == ["k"]
