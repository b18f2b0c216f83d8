"""A 1e1p1d cluster serving in bfloat16 (`--dtype bfloat16`): embeddings and KV blocks cross the data
plane as bf16, and every reply equals Hugging Face generate in bf16.

One lean cluster per (family, transfer): LLaVA over tcp, Qwen2-VL over shm (the sender picks the
backend, so one cluster exercises one of them on both of its links).
"""

from __future__ import annotations

import asyncio

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import MAX_TOKENS, generate_all
from tests.helpers import hf_generate, request_mix, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[("llava", "tcp"), ("qwen2_vl", "shm")], ids=["llava-tcp", "qwen2_vl-shm"])
def bf16_cluster(request, tiny_model_dirs, redis_server):
    arch, transfer = request.param
    model = str(tiny_model_dirs[arch])
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_server.url, transfer=transfer,
                      extra_worker_args=["--dtype", "bfloat16"]) as cluster:
        yield model, transfer, cluster


def test_bf16_cluster_matches_hf_bf16(bf16_cluster):
    model, transfer, cluster = bf16_cluster
    requests = request_mix(6, seed=5)  # text-only, one image, two images
    results = asyncio.run(generate_all(cluster.address, requests))
    builder = PromptBuilder(model)
    for i, ((text, images), res) in enumerate(zip(requests, results)):
        want = hf_generate(model, builder.prepare_text(text, images).prompt_ids, images, MAX_TOKENS, dtype="bfloat16")
        assert res.token_ids == want, f"request {i} ({len(images)} images): {res.token_ids} != {want}"
    # Embeddings reached prefill, and KV blocks decode, over `transfer` (counters come with heartbeats).
    wait_for(lambda: all(fetched(cluster.address, w, transfer) > 0 for w in ("prefill-0", "decode-0")),
             timeout_s=30, what=f"prefill and decode fetches over {transfer} in STATUS")


def fetched(address: str, worker: str, transfer: str) -> int:
    with Client(address, timeout_s=10) as client:
        return client.status()["workers"][worker].get("counters", {}).get(f"transfer_fetched_{transfer}", 0)
