"""Two models of different families served by one coordinator (coordinator/models.py): each request answered
by its own model with HF generate's exact tokens, through the client and the gateway; kill -9 of one model's
decode worker leaves the other's streams untouched; a model missing a pool refuses, naming the role.

One cluster for the whole module (tiny LLaVA, the default, and tiny Qwen2-VL); the tests run in file order
and the last one kills Qwen2-VL's only decode worker.
"""

from __future__ import annotations

import asyncio
import base64
import signal

import httpx
import pytest

from mserve.coordinator.client import AsyncClient, Client, ModelNotFound
from mserve.coordinator.launcher import LocalCluster
from tests.coordinator.test_cluster import expected
from tests.coordinator.test_faults import LONG
from tests.helpers import chat, request_mix, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_models(tiny_model_dirs, redis_server, tmp_path_factory):
    """(llava folder, qwen2_vl folder, cluster, gateway URL): llava 1e1p2d (the default), qwen2_vl 1e1p1d."""
    llava, qwen = str(tiny_model_dirs["llava"]), str(tiny_model_dirs["qwen2_vl"])
    with LocalCluster(llava, encode=1, prefill=1, decode=2, redis_url=redis_server.url, transfer="tcp",
                      other_models=[(qwen, {"encode": 1, "prefill": 1, "decode": 1})],
                      # A variant group over both (qwen2_vl listed as the smaller): routed by latency class.
                      extra_coordinator_args=["--dead-after-s", "1.0", "--variant-groups", f"pair={qwen},{llava}",
                                              "--ttft-slo-ms", "interactive=60000"],
                      log_dir=str(tmp_path_factory.mktemp("two-models-logs"))) as cluster:
        yield llava, qwen, cluster, cluster.start_gateway()


async def generate_for(address: str, model: str | None, requests, max_tokens: int = 8):
    async with AsyncClient(address, timeout_s=120) as client:
        return await asyncio.gather(*[client.generate(chat(text, images), max_tokens=max_tokens,
                                                      **({"model": model} if model else {}))
                                      for text, images in requests])


def test_each_model_answers_its_own_requests_with_hf_exact_tokens(two_models):
    llava, qwen, cluster, _ = two_models
    requests = request_mix(4, seed=21)  # text-only, one image, two images

    async def both():
        return await asyncio.gather(generate_for(cluster.address, llava, requests),
                                    generate_for(cluster.address, qwen, requests),
                                    generate_for(cluster.address, None, requests[:2]))  # no model: the default

    got_llava, got_qwen, got_default = asyncio.run(both())
    want_llava, want_qwen = expected(llava, requests, 8), expected(qwen, requests, 8)
    assert want_llava != want_qwen  # different checkpoints: a request answered by the wrong model would show
    assert [r.token_ids for r in got_llava] == want_llava
    assert [r.token_ids for r in got_qwen] == want_qwen
    assert [r.token_ids for r in got_default] == want_llava[:2]
    with Client(cluster.address, timeout_s=10) as c:
        status = c.status()
    assert status["served_models"] == sorted([llava, qwen, "pair"])
    for model in (llava, qwen):
        assert status["models"][model]["roles"] == ({"encode": 1, "prefill": 1, "decode": 2} if model == llava
                                                    else {"encode": 1, "prefill": 1, "decode": 1})
        assert status["models"][model]["stats"]["completed"] == (len(requests) + 2 if model == llava else len(requests))
    assert {w["model"] for name, w in status["workers"].items() if name.startswith("m1-")} == {qwen}
    with Client(cluster.address, timeout_s=30) as c, pytest.raises(ModelNotFound) as err:
        c.generate(chat("Hi"), model="no-such-model", max_tokens=2)
    assert repr(llava) in str(err.value) and repr(qwen) in str(err.value)


def _gateway_chat(url: str, model: str, text: str, images=(), **kw) -> httpx.Response:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(im).decode()}}
             for im in images]
    body = {"model": model, "max_tokens": 8, "return_token_ids": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_a_variant_group_sends_each_class_to_a_variant_and_the_reply_names_it(two_models):
    llava, qwen, cluster, url = two_models
    requests = request_mix(2, seed=5)[1:]  # one image
    want = {m: expected(m, requests, 8)[0] for m in (llava, qwen)}

    async def ask(model: str, latency_class: str):
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            return await client.generate(chat(*requests[0]), max_tokens=8, model=model, latency_class=latency_class)

    # An idle cluster: both classes go to the largest live variant (listed last), which answers exactly.
    for cls in ("batch", "interactive"):
        got = asyncio.run(ask("pair", cls))
        assert got.model == llava and got.token_ids == want[llava]
    assert asyncio.run(ask(qwen, "interactive")).model == qwen  # a variant by its own name: as asked
    reply = _gateway_chat(url, "pair", *requests[0], latency_class="batch")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == llava and reply.headers["x-mserve-model"] == llava
    assert reply.json()["choices"][0]["token_ids"] == want[llava]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": "pair", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "Say something."}]}) as stream:
        assert stream.headers["x-mserve-model"] == llava
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and all(f'"model":"{llava}"' in line for line in chunks)
    with Client(cluster.address, timeout_s=10) as c:
        status = c.status()
    assert status["variant_groups"] == {"pair": [qwen, llava]}
    assert status["variant_routed"] == {f"pair/{llava}": 4}


def test_the_gateway_lists_and_routes_both_models(two_models):
    llava, qwen, _, url = two_models
    listed = httpx.get(url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in listed["data"]] == [llava, qwen, "pair"]  # the default model first
    requests = request_mix(2, seed=5)[1:]  # one image
    for model in (llava, qwen):
        reply = _gateway_chat(url, model, *requests[0])
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        assert reply.json()["choices"][0]["token_ids"] == expected(model, requests, 8)[0]
    scrape = httpx.get(url + "/metrics", timeout=30).text
    with Client(two_models[2].address, timeout_s=10) as c:
        status = c.status()
    for model in (llava, qwen):  # per-model series; the cluster's histograms sum every model's
        done = status["models"][model]["stats"]["completed"]
        assert f'mserve_model_requests_completed_total{{model="{model}"}} {float(done)}' in scrape
    assert status["telemetry"]["histograms"]["e2e"]["count"] == sum(
        m["telemetry"]["histograms"]["e2e"]["count"] for m in status["models"].values())
    unknown = _gateway_chat(url, "gpt-4", "Hi")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert repr(llava) in unknown.json()["error"]["message"] and repr(qwen) in unknown.json()["error"]["message"]


def test_kill_9_of_one_models_decode_worker_leaves_the_other_models_streams_untouched(two_models):
    llava, qwen, cluster, _ = two_models
    requests = request_mix(6, seed=13)
    killed = asyncio.Event()

    async def one(client, model, text, images):
        stream = client.stream(chat(text, images), max_tokens=LONG, ignore_eos=True, model=model)
        seen = []
        async for tok in stream:
            seen.append(tok)
            if model == llava and len(seen) >= 2 and not killed.is_set():
                killed.set()
                cluster.kill_worker(busiest_llava_decoder(), signal.SIGKILL)
        return seen, stream.result

    def busiest_llava_decoder() -> str:
        """The llava decode worker running the most requests now: the kill surely hits some in flight."""
        with Client(cluster.address, timeout_s=10) as c:
            workers = c.status()["workers"]
        return max(cluster.worker_names("decode", llava),
                   key=lambda w: (workers[w]["load"]["running"] + workers[w]["load"]["inflight"], w))

    async def run():
        async with AsyncClient(cluster.address, timeout_s=120) as client:
            return await asyncio.gather(*[one(client, m, t, ims) for m in (llava, qwen) for t, ims in requests])

    out = asyncio.run(run())
    assert killed.is_set()
    got_llava, got_qwen = out[:len(requests)], out[len(requests):]
    for (streamed, result), want in zip(got_llava, expected(llava, requests, LONG, ignore_eos=True)):
        assert streamed == result.token_ids == want  # the killed model's requests: each exactly once
    assert any(result.attempts > 1 for _, result in got_llava)  # the kill really hit llava requests in flight
    for (streamed, result), want in zip(got_qwen, expected(qwen, requests, LONG, ignore_eos=True)):
        assert streamed == result.token_ids == want and result.attempts == 1  # untouched: never re-run
    with Client(cluster.address, timeout_s=10) as c:
        stats = c.status()["models"]
    assert stats[qwen]["stats"]["reruns"] == 0 and stats[llava]["stats"]["reruns"] >= 1


def test_a_model_missing_its_decode_pool_answers_503_naming_it_and_the_other_serves_on(two_models):
    llava, qwen, cluster, url = two_models
    cluster.kill_worker("m1-decode-0", signal.SIGKILL)  # qwen2_vl's only decode worker

    def qwen_lost_decode():
        with Client(cluster.address, timeout_s=10) as c:
            return "decode" not in c.status()["models"][qwen]["roles"]

    wait_for(qwen_lost_decode, timeout_s=30, what="the coordinator to declare qwen2_vl's decode worker dead")
    refused = _gateway_chat(url, qwen, "Hi")
    assert refused.status_code == 503, refused.text
    assert f"the model {qwen!r} has no live decode worker" in refused.json()["error"]["message"]
    served = _gateway_chat(url, llava, "Hi")
    assert served.status_code == 200 and served.json()["choices"][0]["token_ids"] == expected(llava, [("Hi", [])], 8)[0]
