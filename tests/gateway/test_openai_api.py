"""The gateway's pure parts: OpenAI request validation, text deltas, stop strings, metric rendering."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mserve.coordinator.telemetry import Histogram, Telemetry
from mserve.gateway.metrics import GatewayMetrics
from mserve.gateway.openai_api import ApiError, parse_chat_request, status_for_code
from mserve.gateway.textstream import Detokenizer, StopMatcher
from tests.gateway.chat_requests import body, param_of
from tests.helpers import make_image

IMG = make_image(32, 24)
DATA_URL = "data:image/png;base64," + base64.b64encode(IMG).decode()


def test_supported_fields_become_sampling_options():
    req = parse_chat_request(body(max_completion_tokens=9, max_tokens=3, temperature=0.5, top_p=0.9, seed=4,
                                  top_k=7, ignore_eos=True, stop_token_ids=[5], priority=3, latency_class="batch",
                                  stream=True, stream_options={"include_usage": True}, stop="END", user="u1"))
    assert req.sampling == {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 4,
                            "ignore_eos": True, "stop_token_ids": [5], "priority": 3, "latency_class": "batch"}
    assert req.stream and req.include_usage and req.stop == ["END"]
    assert parse_chat_request(body()).sampling == {"max_tokens": 256}
    assert parse_chat_request(body(), default_max_tokens=5).sampling == {"max_tokens": 5}


def test_neutral_values_of_unsupported_fields_are_accepted():
    req = parse_chat_request(body(n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, tools=None))
    assert req.sampling == {"max_tokens": 256}


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 2}, "best_of"), ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"latency_class": "x"}, "latency_class"),
    ({"priority": 1000}, "priority"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": "yes"}, "stream"), ({"model": None}, "model"), ({"messages": []}, "messages"),
])
def test_unsupported_or_invalid_fields_get_a_400_naming_them(extra, param):
    message_param = param_of(lambda: parse_chat_request(body(**extra)))
    assert message_param == param


def test_messages_are_checked_part_by_part():
    def msgs(*content, role="user"):
        return body(messages=[{"role": role, "content": list(content)}])

    assert param_of(lambda: parse_chat_request(body(messages=[{"role": "tool", "content": "x"}]))) == "messages[0].role"
    assert param_of(lambda: parse_chat_request(msgs({"type": "hologram"}))) == "messages[0].content[0].type"
    assert param_of(lambda: parse_chat_request(msgs({"type": "text", "text": 3}))) == "messages[0].content[0].text"
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(ApiError, match="remote media URLs are not fetched here"):
        parse_chat_request(msgs(remote))
    bad64 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    with pytest.raises(ApiError, match="not valid base64"):
        parse_chat_request(msgs(bad64))
    req = parse_chat_request(msgs({"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": "a"},
                                  {"type": "image_url", "image_url": DATA_URL}))
    assert req.messages[0]["content"][0] == {"type": "image", "image": IMG}
    assert [p["type"] for p in req.messages[0]["content"]] == ["image", "text", "image"]
    assert parse_chat_request(body(messages=[{"role": "developer", "content": "be brief"},
                                             {"role": "user", "content": "hi"}])).messages[0]["role"] == "system"


def test_local_images_only_under_the_allowed_media_path(tmp_path: Path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(IMG)
    (tmp_path / "secret.png").write_bytes(IMG)

    def image(url: str, media_root):
        part = {"type": "image_url", "image_url": {"url": url}}
        return parse_chat_request(body(messages=[{"role": "user", "content": [part]}]), media_root=media_root)

    with pytest.raises(ApiError, match="without --allowed-media-path"):
        image(str(root / "a.png"), None)
    assert image(str(root / "a.png"), root.resolve()).messages[0]["content"][0]["image"] == IMG
    assert image(f"file://{root / 'a.png'}", root.resolve()).messages[0]["content"][0]["image"] == IMG
    assert image("a.png", root.resolve()).messages[0]["content"][0]["image"] == IMG
    for escape in (str(tmp_path / "secret.png"), "../secret.png", f"file://{root}/../secret.png"):
        with pytest.raises(ApiError, match="outside the allowed media path"):
            image(escape, root.resolve())
    with pytest.raises(ApiError, match="no such file"):
        image("missing.png", root.resolve())


def test_error_codes_map_to_http_statuses():
    assert status_for_code("bad_request")[0] == 400 and status_for_code("too_large")[0] == 413
    assert status_for_code("overloaded") == (429, "rate_limit_error")
    assert status_for_code("no_workers")[0] == 503 and status_for_code("timeout")[0] == 504
    assert status_for_code("something_new")[0] == 500


# --------------------------------------------------------------------------- text


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dirs):
    from transformers import AutoTokenizer

    # Indexing builds a family's checkpoint on first use (iterating would see only those built so far).
    return {arch: AutoTokenizer.from_pretrained(str(tiny_model_dirs[arch])) for arch in ("llava", "qwen2_vl")}


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_streamed_deltas_add_up_to_the_whole_decode(tokenizers, arch):
    tok = tokenizers[arch]
    text = "Héllo wörld — ünïcode ✓ 日本語 and plain words, spaces   and\nnew lines."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for step in (1, 2, 3):
        detok = Detokenizer(tok)
        pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
        pieces.append(detok.finish())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces), "half a character was sent"


def test_stop_strings_split_across_deltas_are_never_sent():
    m = StopMatcher(["STOP", "END"])
    out = "".join(m.feed(d) for d in ["Hello S", "T", "OP and more"])
    assert out == "Hello " and m.stopped and m.feed("x") == "" and m.flush() == ""
    m = StopMatcher(["STOP"])
    out = "".join(m.feed(d) for d in ["ST", "ART ", "STO"]) + m.flush()
    assert out == "START STO" and not m.stopped
    assert StopMatcher([]).feed("abc") == "abc"


# --------------------------------------------------------------------------- metrics


def test_histogram_buckets_and_telemetry_snapshot():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.snapshot() == {"le": [0.1, 1.0], "counts": [2, 1, 1], "sum": 3.65, "count": 4}
    t = Telemetry()
    t.on_result({"queue_s": 0.01, "encode_s": 0.2, "prefill_s": 0.3, "transfer_s": 0.0, "decode_s": 1.0},
                arrived=10.0, first_token_at=10.5, now=11.5, prompt_tokens=40, visual_tokens=30, output_tokens=11,
                images=1, cache_hits={"embedding": 1, "prefix_tokens": 16})
    snap = t.snapshot()
    assert snap["histograms"]["ttft"]["count"] == 1 and snap["histograms"]["tpot"]["sum"] == pytest.approx(0.1)
    assert snap["histograms"]["transfer"]["count"] == 0  # a stage that did not run is not a 0 s sample
    assert snap["counters"] == {"prompt_tokens": 40, "visual_tokens": 30, "generation_tokens": 11, "images": 1,
                                "embedding_cache_hits": 1, "prefix_cache_hit_tokens": 16, "images_skipped_by_prefix": 0,
                                # routing's lookups in the Redis index: none in this request-only snapshot
                                "redis_embedding_lookups": 0, "redis_embedding_lookup_hits": 0,
                                "redis_prefix_lookups": 0, "redis_prefix_lookup_hits": 0}


def test_cluster_status_renders_as_prometheus_text():
    t = Telemetry()
    t.on_result({"queue_s": 0.0, "prefill_s": 0.2, "decode_s": 0.4}, arrived=0.0, first_token_at=0.25, now=1.0,
                prompt_tokens=10, visual_tokens=0, output_tokens=4, images=0, cache_hits={})
    status = {"workers": {"decode-0": {"role": "decode", "alive": True,
                                       "load": {"queue_len": 2, "running": 3, "free_blocks": 90, "total_blocks": 100,
                                                "rss_mib": 10.0, "tokens_per_s": 5.5},
                                       "counters": {"decode_tokens": 42, "used_blocks": 10, "batch_size": 3,
                                                    "unknown_counter": 1}}},
              "roles": {"decode": 1}, "requests_in_flight": 3, "stats": {"admitted": 5, "completed": 1,
                                                                                 "encode_deduplicated": 7},
              "telemetry": t.snapshot(), "rss_mib": 1.0}
    text, content_type = GatewayMetrics().render(status)
    assert content_type.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}
    w = (("role", "decode"), ("worker", "decode-0"))
    assert samples[("mserve_worker_queue_depth", w)] == 2 and samples[("mserve_worker_batch_size", w)] == 3
    assert samples[("mserve_worker_decode_tokens_total", w)] == 42
    assert samples[("mserve_worker_resident_memory_bytes", w)] == 10 * 2**20
    assert samples[("mserve_workers_alive", (("role", "decode"),))] == 1
    assert samples[("mserve_requests_completed_total", ())] == 1 and samples[("mserve_requests_in_flight", ())] == 3
    assert samples[("mserve_requests_encode_deduplicated_total", ())] == 7
    assert samples[("mserve_time_to_first_token_seconds_count", ())] == 1
    assert samples[("mserve_request_stage_seconds_bucket", (("le", "+Inf"), ("stage", "decode")))] == 1
    assert samples[("mserve_coordinator_up", ())] == 1
    down, _ = GatewayMetrics().render(None)
    assert b"mserve_coordinator_up 0.0" in down and b"mserve_worker_up" not in down


def test_video_parts_become_mserve_video_parts():
    frames = [make_image(32, 24, seed=i) for i in range(3)]
    urls = ["data:image/png;base64," + base64.b64encode(f).decode() for f in frames]
    clip = b"\x00\x00\x00\x18ftypmp42 not really a video"
    clip_url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    req = parse_chat_request(body(messages=[{"role": "user", "content": [
        {"type": "video", "video": urls}, {"type": "video_url", "video_url": {"url": clip_url}},
        {"type": "text", "text": "What happens?"}]}]))
    assert req.messages[0]["content"] == [{"type": "video", "video": frames}, {"type": "video", "video": clip},
                                          {"type": "text", "text": "What happens?"}]
    # frames may carry the rate they were taken at, which the server's video part takes as its fps
    req = parse_chat_request(body(messages=[{"role": "user", "content": [{"type": "video", "video": urls, "fps": 4}]}]))
    assert req.messages[0]["content"] == [{"type": "video", "video": frames, "fps": 4.0}]
    from mserve.common.prompt import normalize_messages

    assert normalize_messages(req.messages, allow_paths=False)[1][0].fps == 4.0


@pytest.mark.parametrize("part, param", [
    ({"type": "video", "video": []}, "messages[0].content[0].video"),
    ({"type": "video", "video": DATA_URL}, "messages[0].content[0].video"),
    ({"type": "video", "video": [DATA_URL, "https://example.com/f.png"]}, "messages[0].content[0].video[1]"),
    ({"type": "video_url", "video_url": {}}, "messages[0].content[0].video_url"),
    ({"type": "video", "video": [DATA_URL], "fps": 0}, "messages[0].content[0].fps"),
    ({"type": "video", "video": [DATA_URL], "fps": "2"}, "messages[0].content[0].fps"),
    ({"type": "video_url", "video_url": {"url": DATA_URL, "fps": 2}}, "messages[0].content[0].video_url.fps"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "messages[0].content[0].video_url"),
])
def test_bad_video_parts_name_the_field(part, param):
    assert param_of(lambda: parse_chat_request(body(messages=[{"role": "user", "content": [part]}]))) == param
