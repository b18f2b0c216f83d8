"""Reduced precision through a real 1e1p1d cluster: embeddings and KV blocks cross the data plane in
the workers' dtype, and every reply is HF generate's in that dtype (common/exactness.py's rule).

Two lean clusters: LLaVA over tcp with `--dtype bfloat16` named, and Qwen2-VL over shm started as a
user starts one, with no dtype or attention flag (the suite's MSERVE_DTYPE removed): its replies are
checked against HF in the dtype the serving default picks on this host (bfloat16 where the CPU has
native bf16, else float32 bit for bit). The sender picks the transfer backend, so each cluster
exercises its backend on both of its links.
"""

from __future__ import annotations

import asyncio

import pytest

from mserve.common.exactness import compare_greedy
from mserve.common.prompt import PromptBuilder
from mserve.common.serving_defaults import serving_dtype_for
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import MAX_TOKENS, generate_all
from tests.helpers import hf_generate_top2, request_mix, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[("llava", "tcp", "bfloat16"), ("qwen2_vl", "shm", None)],
                ids=["llava-tcp-bf16", "qwen2_vl-shm-default"])
def reduced_cluster(request, tiny_model_dirs, redis_server):
    arch, transfer, dtype = request.param
    model = str(tiny_model_dirs[arch])
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MSERVE_DTYPE", raising=False)  # the default path: what `mserve up` gives a user
        with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_server.url, transfer=transfer,
                          extra_worker_args=["--dtype", dtype] if dtype else []) as cluster:
            yield model, transfer, serving_dtype_for("cpu", dtype, model), cluster


def test_cluster_matches_hf_in_its_dtype(reduced_cluster):
    model, transfer, dtype, cluster = reduced_cluster
    requests = request_mix(6, seed=5)  # text-only, one image, two images
    results = asyncio.run(generate_all(cluster.address, requests))
    builder = PromptBuilder(model)
    compared = 0
    for i, ((text, images), res) in enumerate(zip(requests, results)):
        want, top2 = hf_generate_top2(model, builder.prepare_text(text, images).prompt_ids, images, MAX_TOKENS,
                                      dtype=dtype)
        verdict = compare_greedy(want, res.token_ids, top2, dtype)
        assert verdict.exact, f"request {i} ({len(images)} images, {dtype}): {verdict.describe()}"
        compared += verdict.compared
    # Not vacuous: a tiny random model's logits are flat (near-ties are common), yet a third of all steps
    # were compared, each one a token a wrong engine would likely have changed.
    assert compared >= len(requests) * MAX_TOKENS // 3
    for worker in ("encode-0", "prefill-0", "decode-0"):  # the dtype compared in is the one the workers run
        assert f"weights in {dtype}, padded attention" in cluster.log_path(worker).read_text(), worker
    # Embeddings reached prefill, and KV blocks decode, over `transfer` (counters come with heartbeats).
    wait_for(lambda: all(fetched(cluster.address, w, transfer) > 0 for w in ("prefill-0", "decode-0")),
             timeout_s=30, what=f"prefill and decode fetches over {transfer} in STATUS")


def fetched(address: str, worker: str, transfer: str) -> int:
    with Client(address, timeout_s=10) as client:
        return client.status()["workers"][worker].get("counters", {}).get(f"transfer_fetched_{transfer}", 0)
