"""The HTTP gateway in front of real clusters, driven by the official `openai` package and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster
from mserve.common.documents import DocumentLimits, model_page_budget, render_pdf
from tests.clusters import settled_counters
from tests.gateway.media_server import MediaServer
from tests.helpers import hf_generate, make_image, make_pdf, wait_for
from lab.otlp_sink import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow
KEY = "test-key"
MAX_PIXELS = 160 * 120
MEDIA_TOTAL_S = 4  # the llava gateway's --media-total-timeout-s


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_part(image: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def conversation(seed: int) -> tuple[list[dict], list[dict]]:
    """(OpenAI messages, the same with image bytes for PromptBuilder): two images in one turn, then a second turn."""
    a, b, c = (make_image(64 + 16 * i, 48 + 8 * i, seed=seed + i) for i in range(3))
    openai_msgs = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": [image_part(a), image_part(b), {"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": "The first is darker."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(c)]},
    ]
    raw = [dict(m) for m in openai_msgs]
    raw[1] = {"role": "user", "content": [{"type": "image", "image": a}, {"type": "image", "image": b},
                                          {"type": "text", "text": "Compare them."}]}
    raw[3] = {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": c}]}
    return openai_msgs, raw


def oracle(model: str, raw_messages: list[dict], max_tokens: int) -> tuple[int, list[int]]:
    prompt = PromptBuilder(model).prepare(raw_messages)
    return len(prompt.prompt_ids), hf_generate(model, prompt.prompt_ids, prompt.images, max_tokens, ignore_eos=True)


class Served:
    def __init__(self, cluster: LocalCluster, url: str, model: str, key: str | None) -> None:
        self.cluster, self.url, self.model, self.key = cluster, url, model, key
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0, timeout=120)

    def status(self) -> dict:
        with Client(self.cluster.address, timeout_s=5) as c:
            return c.status()

    def scrape(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def serve(model, redis_url, pools, coordinator_args=(), gateway_args=(), key=None,
          require_serving=True) -> tuple[LocalCluster, Served]:
    cluster = LocalCluster(model, redis_url=redis_url, extra_coordinator_args=list(coordinator_args), **pools)
    cluster.start()
    try:
        url = cluster.start_gateway(extra_args=[*gateway_args, *(["--api-key", key] if key else [])],
                                    require_serving=require_serving)
    except BaseException:
        cluster.stop()
        raise
    return cluster, Served(cluster, url, model, key)


@pytest.fixture(scope="module")
def llava(tiny_model_dirs, redis_server):
    """1e1p1d behind the gateway, every process tracing to a real OTLP receiver (the standard variables)."""
    with OtlpReceiver() as otlp, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: spans leave soon after they end
        cluster, served = serve(str(tiny_model_dirs["llava"]), redis_server.url,
                                {"encode": 1, "prefill": 1, "decode": 1},
                                ["--max-image-pixels", str(MAX_PIXELS), "--max-waiting-requests", "2"],
                                ["--max-request-bytes", "1000000", "--served-model-name", "tiny-llava",
                                 # media URLs from MediaServer on 127.0.0.1 (test_remote_media_...)
                                 "--allow-loopback-media-for-tests", "--media-total-timeout-s", str(MEDIA_TOTAL_S)],
                                key=KEY)
        served.model, served.otlp = "tiny-llava", otlp
        with cluster:
            yield served


@pytest.fixture(scope="module")
def qwen(tiny_model_dirs, redis_server):
    """A unified worker behind a gateway whose images go inline, through the coordinator (--media-store-host
    none; every other gateway here runs its media store, the default)."""
    pools = {"unified": 1, "encode": 0, "prefill": 0, "decode": 0}
    cluster, served = serve(str(tiny_model_dirs["qwen2_vl"]), redis_server.url, pools,
                            gateway_args=["--media-store-host", "none"])
    with cluster:
        yield served


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_chat_with_images_matches_hf_streaming_and_not(family, request, tiny_model_dirs):
    served: Served = request.getfixturevalue(family)
    model_dir = str(tiny_model_dirs["llava" if family == "llava" else "qwen2_vl"])
    msgs, raw = conversation(seed=3)
    prompt_len, want = oracle(model_dir, raw, 10)
    extra = {"ignore_eos": True, "return_token_ids": True}
    full = served.client.chat.completions.create(model=served.model, messages=msgs, max_tokens=10, extra_body=extra)
    choice = full.choices[0]
    assert choice.token_ids == want, "greedy tokens through the gateway differ from HF generate"
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert full.usage.prompt_tokens == prompt_len and full.usage.completion_tokens == len(want)
    assert full.usage.total_tokens == prompt_len + len(want)

    chunks = list(served.client.chat.completions.create(
        model=served.model, messages=msgs, max_completion_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert ids == want and text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])
    # The llava gateway's images went to the workers through its media store (the default), none through the
    # coordinator; the qwen gateway's (--media-store-host none) went inline.
    assert (served.status()["stats"]["media_bytes_inline"] == 0) == (family == "llava")


def test_remote_media_urls_are_fetched_safely_and_answered_as_the_same_image_inline(llava):
    """An http image URL (MediaServer on 127.0.0.1, let through by --allow-loopback-media-for-tests) gets
    exactly the tokens of the same image sent as a data URL; a trickling server times out while other
    requests flow through the same gateway. Blocked address classes are tested in test_media_fetch.py, where
    the resolver and connector are the test's own and no connection to them is ever attempted."""
    img = make_image(64, 48, seed=11)
    extra = {"ignore_eos": True, "return_token_ids": True}

    def ask(url: str, client: openai.OpenAI = llava.client):
        return client.chat.completions.create(model=llava.model, max_tokens=8, extra_body=extra, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}])

    with MediaServer({"/cat.png": ("image/png", img, {"Cache-Control": "max-age=600"})}) as media:
        inline = ask(data_url(img))
        for _ in range(2):
            remote = ask(media.base + "/cat.png")
            assert remote.choices[0].token_ids == inline.choices[0].token_ids
            assert remote.usage.prompt_tokens == inline.usage.prompt_tokens
        assert media.requests["/cat.png"] == 1  # the second came from the gateway's HTTP cache

        slow: list[BaseException] = []
        patient = openai.OpenAI(base_url=llava.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        trickle = threading.Thread(target=lambda: slow.append(pytest.raises(openai.BadRequestError, ask,
                                                                           media.base + "/trickle", patient).value))
        trickle.start()
        wait_for(lambda: media.requests["/trickle"] == 1, timeout_s=30, what="the gateway to start the trickle")
        assert ask(data_url(img)).choices[0].token_ids == inline.choices[0].token_ids
        assert trickle.is_alive(), "a trickling fetch held the gateway"
        trickle.join(timeout=60)
        assert f"media_total_timeout_s={MEDIA_TOTAL_S}" in slow[0].body["message"]


def encoded_images(served: Served) -> int:
    return sum(c.get("encoded_images", 0) for c in settled_counters(served.cluster).values())


@pytest.mark.parametrize("family", ["llava", "qwen"])  # a fixed-size processor; one that sizes by the page's pixels
def test_a_pdf_file_part_is_answered_as_its_pages_and_a_page_seen_before_skips_its_encode(family, request,
                                                                                          tiny_model_dirs):
    """OpenAI's `file` part with a 2-page PDF: the answer is HF generate's on its pages sent as images, token
    for token; its first page, sent before as an image, is not encoded again; a bad PDF is a 400 naming it."""
    served: Served = request.getfixturevalue(family)
    pdf = make_pdf([(90, 60), (60, 90)], seed=21)  # small pages: at the tiny models' budgets, under MAX_PIXELS
    folder = tiny_model_dirs["llava" if family == "llava" else "qwen2_vl"]
    pages = render_pdf(pdf, DocumentLimits(budget=model_page_budget(folder)))  # as the gateway renders for the model
    doc = {"type": "file", "file": {"filename": "a.pdf",
                                    "file_data": "data:application/pdf;base64," + base64.b64encode(pdf).decode()}}

    def ask(content: list[dict]) -> list[int]:
        reply = served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": content}], max_tokens=6,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        return reply.choices[0].token_ids

    ask([image_part(pages[0]), {"type": "text", "text": "What is this?"}])
    before = encoded_images(served)
    got = ask([doc, {"type": "text", "text": "Summarize."}])
    assert encoded_images(served) == before + 1, "only the page not seen before is encoded"
    raw = [{"role": "user", "content": [{"type": "image", "image": pages[0]}, {"type": "image", "image": pages[1]},
                                        {"type": "text", "text": "Summarize."}]}]
    assert got == oracle(str(folder), raw, 6)[1]
    assert ask([image_part(pages[0]), image_part(pages[1]), {"type": "text", "text": "Summarize."}]) == got
    with pytest.raises(openai.BadRequestError) as info:
        ask([{"type": "file", "file": {**doc["file"], "file_data": doc["file"]["file_data"][:400]}}])
    assert info.value.body["param"] == "messages[0].content[0].file.file_data"
    assert "cannot be read" in info.value.body["message"]


def test_stop_string_ends_the_answer_and_frees_the_request(llava):
    msgs, _ = conversation(seed=5)
    full = llava.client.chat.completions.create(model=llava.model, messages=msgs, max_tokens=16,
                                                extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert len(text) > 6
    stop = text[4:7]
    want = text[:text.find(stop)]
    for stream in (False, True):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        out = llava.client.chat.completions.create(model=llava.model, messages=msgs, max_tokens=16, stop=[stop],
                                                   extra_body={"ignore_eos": True}, **kw)
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
            usage = chunks[-1].usage
        else:
            got, reason, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
        assert got == want and reason == "stop"
        assert usage.prompt_tokens == full.usage.prompt_tokens and 0 < usage.completion_tokens <= 16
    wait_until(lambda: llava.status()["requests_in_flight"] == 0, "stopped requests leave the cluster")


def test_errors_come_in_openai_shape_with_the_right_status(llava):
    msgs = [{"role": "user", "content": "hello"}]
    anonymous = openai.OpenAI(base_url=llava.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e401:
        anonymous.chat.completions.create(model=llava.model, messages=msgs)
    assert e401.value.status_code == 401
    r = httpx.get(llava.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert [m.id for m in llava.client.models.list().data] == ["tiny-llava"]

    with pytest.raises(openai.BadRequestError) as e400:
        llava.client.chat.completions.create(model=llava.model, messages=msgs, n=2)
    assert e400.value.status_code == 400 and e400.value.body["param"] == "n" and "'n'" in e400.value.message
    with pytest.raises(openai.NotFoundError):
        llava.client.chat.completions.create(model="gpt-4o", messages=msgs)

    big = make_image(200, 150)  # 30,000 pixels: over the coordinator's max_image_pixels
    with pytest.raises(openai.APIStatusError) as e413:
        llava.client.chat.completions.create(
            model=llava.model, messages=[{"role": "user", "content": [image_part(big), {"type": "text", "text": "x"}]}])
    assert e413.value.status_code == 413 and f"max_image_pixels={MAX_PIXELS}" in e413.value.message
    huge = {"model": llava.model, "messages": [{"role": "user", "content": "x" * 1_200_000}]}
    r = httpx.post(llava.url + "/v1/chat/completions", json=huge, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "max_request_bytes=1000000" in r.json()["error"]["message"]
    r = httpx.post(llava.url + "/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_overload_is_a_429_with_retry_after(llava):
    """max_waiting_requests=2: a burst sheds some requests with 429 + Retry-After; every one ends."""
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=llava.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            body = {"model": llava.model, "messages": [{"role": "user", "content": "Tell me a story."}],
                    "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*[http.post("/v1/chat/completions", json=body) for _ in range(10)])

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    for r in replies:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error" and "max_waiting_requests" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    wait_until(lambda: llava.status()["requests_in_flight"] == 0, "the burst drains")


def wait_until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def test_client_disconnect_aborts_on_every_stage_and_frees_kv(llava):
    body = {"model": llava.model, "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": [image_part(make_image(64, 48, seed=9)),
                                                      {"type": "text", "text": "Describe it at length."}]}]}
    with httpx.Client(base_url=llava.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # the role chunk and a few tokens: decoding has started
            assert any('"content"' in line for line in got)
            assert llava.status()["requests_in_flight"] == 1
    # The connection is closed mid-stream: the gateway aborts, the coordinator cancels on the worker.
    def freed() -> bool:
        status = llava.status()
        workers = status["workers"]
        kv_idle = all(w["counters"].get("used_blocks", 0) == 0 for w in workers.values() if w["role"] != "encode")
        return status["requests_in_flight"] == 0 and kv_idle
    wait_until(freed, "the aborted request's KV blocks are freed on every worker")


def test_metrics_count_the_traffic_sent(llava):
    before = llava.scrape()
    msgs, _ = conversation(seed=11)
    outs = [llava.client.chat.completions.create(model=llava.model, messages=msgs, max_tokens=5,
                                                 extra_body={"ignore_eos": True}) for _ in range(3)]
    wait_until(lambda: llava.scrape()[("mserve_requests_completed_total", ())]
               - before.get(("mserve_requests_completed_total", ()), 0) == 3, "the coordinator counted 3 results")
    after = llava.scrape()

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("mserve_gateway_requests_total", (("outcome", "ok"),)) == 3
    assert grew("mserve_generation_tokens_total") == 15 == sum(o.usage.completion_tokens for o in outs)
    assert grew("mserve_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert grew("mserve_images_total") == 9
    assert grew("mserve_time_to_first_token_seconds_count") == 3
    # The same three images each time: encoded once (or before this test), then served from the embedding
    # cache, or not encoded at all once the prefill worker's cached prefix holds them (as soon as the prefix
    # index has its blocks: a request whose images are all held has no encode stage).
    encodes, skipped = grew("mserve_request_stage_seconds_count", (("stage", "encode"),)), grew(
        "mserve_images_skipped_by_prefix_total")
    assert 1 <= encodes <= 3 and encodes + skipped // 3 >= 3
    assert grew("mserve_embedding_cache_hits_total") + skipped >= 6
    assert after[("mserve_workers_alive", (("role", "decode"),))] == 1
    enc = (("role", "encode"), ("worker", "encode-0"))
    wait_until(lambda: llava.scrape().get(("mserve_worker_visual_tokens_total", enc), 0) > 0,
               "the encode worker's heartbeat reports its visual tokens")
    assert after[("mserve_coordinator_up", ())] == 1


def test_health_and_503_when_no_worker_can_serve(tiny_model_dirs, redis_server):
    cluster, served = serve(str(tiny_model_dirs["llava"]), redis_server.url,
                            {"encode": 1, "prefill": 0, "decode": 0}, ["--stage-timeout-s", "1"],
                            require_serving=False)
    with cluster:
        r = httpx.get(served.url + "/health")
        assert r.status_code == 503 and "need unified, or prefill + decode" in r.json()["reason"]
        with pytest.raises(openai.APIStatusError) as e503:
            served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}])
        assert e503.value.status_code == 503


# The spans one request through 1e1p1d must have, by service (docs/operations.md, "Tracing").
TRACE_SPANS = {
    "mserve-gateway": {"POST /v1/chat/completions"},
    "mserve-coordinator": {"request", "admission", "encode.queue", "encode", "prefill.queue", "prefill",
                           "decode.queue", "decode"},
    "mserve-encode": {"encode worker", "encode.worker_queue", "encode.preprocess", "encode.compute"},
    "mserve-prefill": {"prefill worker", "embedding.transfer"},
    "mserve-decode": {"decode worker", "kv.transfer"},
}


def span_tree(spans: list[ReceivedSpan], root_parent: str) -> str:
    """The spans as an indented tree under the client's span (for the failure message and the note)."""
    children: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_id, []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.name):
            lines.append(f"{'  ' * depth}{s.name} [{s.service}]")
            walk(s.span_id, depth + 1)

    walk(root_parent, 0)
    return "\n".join(lines)


def test_one_request_is_one_connected_trace_through_every_process(llava):
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    image = make_image(80, 60, seed=77)
    body = {"model": llava.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": [image_part(image), {"type": "text", "text": "What is it?"}]}]}
    reply = httpx.post(llava.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}", "traceparent": f"00-{trace_id}-{client_span}-01"})
    assert reply.status_code == 200, reply.text

    def complete():
        spans = llava.otlp.trace(trace_id)
        names = {(s.service, s.name) for s in spans}
        return spans if all((svc, n) in names for svc, want in TRACE_SPANS.items() for n in want) else None

    spans = wait_for(complete, timeout_s=30, what="every process's spans of the request at the OTLP receiver")
    tree = span_tree(spans, client_span)
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids or s.parent_id == client_span for s in spans), tree  # one connected tree
    assert [s.name for s in spans if s.parent_id == client_span] == ["POST /v1/chat/completions"], tree
    assert len({s.span_id for s in spans}) == len(spans) and not any(s.error for s in spans), tree
    by_name = {s.name: s for s in spans}
    assert by_name["request"].attributes["mserve.images"] == 1 and by_name["request"].attributes["mserve.attempts"] == 1
    assert by_name["encode worker"].attributes["mserve.embedding_cache_hits"] == 0
    assert "mserve.prefix_cache_hit_tokens" in by_name["prefill worker"].attributes
    print("\n" + tree)  # the tree the closing note shows (pytest -s)


def test_a_request_without_traceparent_starts_its_own_trace(llava):
    before = {s.trace_id for s in llava.otlp.spans}
    llava.client.chat.completions.create(model=llava.model, max_tokens=2,
                                         messages=[{"role": "user", "content": "Hello there."}])

    def new_trace():  # the coordinator's request span and the gateway's, both in
        fresh = [s for s in llava.otlp.spans if s.trace_id not in before and s.name == "request"]
        names = {s.name for s in llava.otlp.trace(fresh[0].trace_id)} if fresh else set()
        return fresh[0] if "POST /v1/chat/completions" in names and "decode worker" in names else None

    request = wait_for(new_trace, timeout_s=30, what="the text-only request's trace")
    spans = llava.otlp.trace(request.trace_id)
    roots = [s for s in spans if s.parent_id == ""]
    assert [s.name for s in roots] == ["POST /v1/chat/completions"]
    assert not any(s.name.startswith("encode") for s in spans)  # text only: no encode stage
