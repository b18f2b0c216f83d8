"""SLO-adaptive pruning with real processes (1e1p1d LLaVA): a class past its TTFT objective is admitted
pruned, its tokens are HF generate's on the same FasterVLM-pruned embeddings, and the reply says so; a class
within its objective is never pruned and stays exact against the unpruned model."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from tests.helpers import chat, hf_generate, make_image, wait_for
from tests.workers.test_pruning import MAX_NEW, PROMPT, reference_generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llava(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llava"])


@pytest.fixture(scope="module")
def cluster(llava):
    # interactive: an objective of 1 µs, broken as soon as one image waits to encode, held for an hour;
    # batch: an hour, never broken here.
    args = ["--adaptive-pruning", "interactive=0.5,batch=0.5", "--ttft-slo-ms", "interactive=0.001,batch=3600000",
            "--adaptive-pruning-hold-s", "3600"]
    with LocalCluster(llava, encode=1, prefill=1, decode=1, transfer="shm", extra_coordinator_args=args) as c:
        c.gateway_url = c.start_gateway()
        yield c


def test_a_class_past_its_objective_is_pruned_exactly_and_one_within_it_never(cluster, llava):
    image = make_image(200, 150, seed=7)
    full_ids = PromptBuilder(llava).prepare_text(PROMPT, [image]).prompt_ids
    pruned_ids = PromptBuilder(llava, visual_token_pruning=0.5).prepare_text(PROMPT, [image]).prompt_ids
    sampling = {"max_tokens": MAX_NEW, "ignore_eos": True, "timeout_s": 120}
    with Client(cluster.address, timeout_s=120) as c:
        # Nothing was queued when the first request came: admitted whole, exact against HF.
        first = c.generate(chat(PROMPT, [image]), **sampling)
        assert first.visual_keep_ratio is None and first.prompt_tokens == len(full_ids)
        assert first.token_ids == hf_generate(llava, full_ids, [image], MAX_NEW, ignore_eos=True)
        # Its image waiting to encode broke the 1 µs objective: interactive prunes from then on.
        wait_for(lambda: c.status()["adaptive_pruning"]["pruning"] == ["interactive"], 30, "interactive pruning")
        # The same image again: pruned to half, never served the first request's unpruned embeddings.
        second = c.generate(chat(PROMPT, [image]), **sampling)
        assert second.visual_keep_ratio == 0.5 and second.prompt_tokens == len(pruned_ids) < len(full_ids)
        assert second.token_ids == reference_generate(llava, pruned_ids, [image], 0.5)
        # batch is within its objective: never pruned, exact against the unpruned model.
        for seed in (8, 9):
            other = make_image(160, 240, seed=seed)
            ids = PromptBuilder(llava).prepare_text(PROMPT, [other]).prompt_ids
            res = c.generate(chat(PROMPT, [other]), latency_class="batch", **sampling)
            assert res.visual_keep_ratio is None and res.prompt_tokens == len(ids)
            assert res.token_ids == hf_generate(llava, ids, [other], MAX_NEW, ignore_eos=True)
        status = c.status()
        assert status["stats"]["pruned_adaptive"] == 1 and status["adaptive_pruning"]["pruning"] == ["interactive"]


def test_the_http_reply_says_when_it_was_pruned(cluster, llava):
    """Header and `mserve` object when pruned (interactive prunes for the hour once one image waited)."""
    with Client(cluster.address, timeout_s=120) as c:
        if c.status()["adaptive_pruning"]["pruning"] != ["interactive"]:  # this test alone: start it
            c.generate(chat(PROMPT, [make_image(64, 64, seed=1)]), max_tokens=1)
        wait_for(lambda: c.status()["adaptive_pruning"]["pruning"] == ["interactive"], 30, "interactive pruning")
    image = make_image(120, 90, seed=11)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"max_tokens": 4, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": PROMPT}]}]}
    pruned_ids = PromptBuilder(llava, visual_token_pruning=0.5).prepare_text(PROMPT, [image]).prompt_ids
    with httpx.Client(base_url=cluster.gateway_url, timeout=120) as http:
        body["model"] = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["X-MServe-Visual-Keep-Ratio"] == "0.5"
        reply = r.json()
        assert reply["mserve"] == {"visual_keep_ratio": 0.5} and reply["usage"]["prompt_tokens"] == len(pruned_ids)
        assert reply["choices"][0]["token_ids"] == reference_generate(llava, pruned_ids, [image], 0.5)[:4]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [e.get("mserve") for e in events if e["choices"] and e["choices"][0]["finish_reason"]] == \
            [{"visual_keep_ratio": 0.5}]
        r = http.post("/v1/chat/completions", json={**body, "latency_class": "batch"})
        assert r.status_code == 200 and "X-MServe-Visual-Keep-Ratio" not in r.headers and "mserve" not in r.json()
