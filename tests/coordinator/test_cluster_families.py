"""The families beyond LLaVA-1.5 and Qwen2-VL through a real 1e1p1d cluster: exactly HF generate's tokens."""

from __future__ import annotations

import asyncio

import pytest

from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected, generate_all
from tests.helpers import request_mix

pytestmark = pytest.mark.slow
FAMILIES = ["llava_next", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_cluster(request, tiny_model_dirs, redis_server):
    """(model folder, cluster): one lean 1e1p1d cluster per family, shared by this module's tests."""
    model = str(tiny_model_dirs[request.param])
    with LocalCluster(model, encode=1, prefill=1, decode=1, redis_url=redis_server.url, transfer="tcp") as cluster:
        yield model, cluster


def test_text_image_and_multi_image_requests_match_hf(family_cluster):
    model, cluster = family_cluster
    requests = request_mix(6, seed=11)  # text-only, one image, two images, of varied sizes
    results = asyncio.run(generate_all(cluster.address, requests))
    again = asyncio.run(generate_all(cluster.address, requests[1:3]))  # the same images again: cached
    for i, (res, exp) in enumerate(zip(results, expected(model, requests))):
        assert res.token_ids == exp, f"request {i} ({len(requests[i][1])} images): {res.token_ids} != {exp}"
    assert [r.token_ids for r in again] == [r.token_ids for r in results[1:3]]
    assert all(r.timings["encode_s"] > 0 for r, (_, ims) in zip(results, requests) if ims)
