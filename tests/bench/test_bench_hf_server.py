"""bench/hf_server.py: an SSE chat completion with an image gives exactly Hugging Face greedy generate's tokens."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest

from mserve.bench.http_target import HttpOptions, build_payload, image_data_url, run_request
from mserve.bench.traces import make_trace
from mserve.common.prompt import PromptBuilder
from tests.helpers import hf_generate, make_image

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf_server(tiny_model_dirs):
    from mserve.bench.hf_server import HFGenerator, Server

    server = Server(("127.0.0.1", 0), HFGenerator(str(tiny_model_dirs["llava"]), threads=1), "tiny")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _post(port: int, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _events(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]


def test_sse_with_image_matches_hf_generate(hf_server, tiny_model_dirs) -> None:
    model = str(tiny_model_dirs["llava"])
    image, text = make_image(120, 90, seed=4), "Describe the picture in detail."
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(image)}}, {"type": "text", "text": text}]}]}
    status, raw = _post(hf_server.server_address[1], body)
    assert status == 200
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    assert len(token_chunks) == MAX_TOKENS
    streamed_ids = [c["choices"][0]["token_ids"][0] for c in token_chunks]
    streamed_text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])

    builder = PromptBuilder(model)
    prompt = builder.prepare_text(text, [image])
    want = hf_generate(model, prompt.prompt_ids, [image], MAX_TOKENS, ignore_eos=True)
    assert streamed_ids == want
    assert streamed_text == builder.decode(want)
    usage = chunks[-1]["usage"]
    assert usage == {"prompt_tokens": len(prompt.prompt_ids), "completion_tokens": MAX_TOKENS,
                     "total_tokens": len(prompt.prompt_ids) + MAX_TOKENS}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

    # Non-streamed: the same answer in one body.
    status, raw = _post(hf_server.server_address[1], {**body, "stream": False})
    assert status == 200
    reply = json.loads(raw)
    assert reply["choices"][0]["message"]["content"] == builder.decode(want)
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS


def test_http_target_counts_every_token_and_refusals_are_errors(hf_server) -> None:
    base = f"http://127.0.0.1:{hf_server.server_address[1]}/v1"
    reqs = make_trace("mixed", 4, seed=2, max_tokens=6, prompt_tokens=8, resolutions=[((64, 48), 1.0)])
    opts = HttpOptions(extra_body={"ignore_eos": True})

    async def run_all():
        return await asyncio.gather(*[run_request(opts, base, "tiny", r) for r in reqs])

    for rec in asyncio.run(run_all()):
        assert rec.ok, rec.error
        assert rec.output_tokens == 6 and len(rec.token_times_s) == 6 and rec.prompt_tokens > 0
    bad = build_payload("tiny", reqs[0])
    bad["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]
    status, raw = _post(hf_server.server_address[1], bad)
    assert status == 400 and "file path" in json.loads(raw)["error"]["message"]
