"""The embedding tiers count their evictions (workers/embedding_tiers.py): what /metrics shows as
mserve_worker_embedding_l1_evictions_total and _l2_evictions_total, and L1's bytes. In-process, no Redis."""

from __future__ import annotations

import torch

from mserve.workers.embedding_tiers import EmbeddingTiers
from mserve.workers.model_runner import EncodedImage


def test_each_tier_counts_what_it_evicts(tmp_path):
    one = 4 * 8 * 4  # bytes of one 4 x 8 float32 embedding
    counters: dict = {}
    tiers = EmbeddingTiers(l1_bytes=2 * one, l2_bytes=3 * (64 + one), l2_dir=str(tmp_path), namespace="t",
                           model_name="m", worker_id="w", host_id="h", store=None, counters=counters)
    for i in range(5):
        tiers.put(f"img{i}", EncodedImage(torch.full((4, 8), float(i)), None))
    assert counters["embedding_l1_evictions"] == 3  # L1 holds 2 of the 5
    assert counters["embedding_l1_bytes"] == 2 * one  # ... and says how many bytes (a gauge in /metrics)
    assert len(tiers.host_cache.keys()) == 3 and counters["embedding_l2_evictions"] == 2  # 64-byte header each
    assert counters["embedding_l2_bytes"] == tiers.host_cache.used_bytes() == 3 * (64 + one)
    assert tiers.lookup("img4") is not None and counters["embedding_l1_hits"] == 1
