"""Bench support for model-variant groups (issue 21): a latency-class mix, classes sent over HTTP, the served
model recorded per request and counted per configuration, so that one `mserve bench compare` run against an
OpenAI-compatible server reads a group of variants beside its largest variant alone."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from mserve.bench.compare import ConfigSpec, parse_config, served_model_rows
from mserve.bench.http_target import build_payload
from mserve.bench.metrics import RequestRecord, summarize
from mserve.bench.traces import load_trace, make_trace
from mserve.bench.zmq_target import served_model
from mserve.cli import build_parser
from mserve.cli import main as cli_main
from mserve.common.protocol.client import Result

# A server holding the group "llava" of two variants: interactive to the small one, batch to the large one.
GROUP_ROUTE = {"interactive": "llava-small", "batch": "llava-large"}


class GroupServer(BaseHTTPRequestHandler):
    """A streaming chat endpoint that names the variant answering in every chunk's `model`, as OpenAI does."""

    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        asked = body["model"]
        served = GROUP_ROUTE[body["latency_class"]] if asked == "llava" else asked
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for text in ("a", "b"):
            chunk = {"model": served, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def group_server():
    GroupServer.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), GroupServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    thread.join()
    server.server_close()


def test_one_compare_run_reads_the_group_beside_its_largest_variant(group_server, tmp_path, capsys) -> None:
    out = tmp_path / "cmp"
    large, group = f"openai:{group_server}@model=llava-large", f"openai:{group_server}@model=llava"
    rc = cli_main(["bench", "compare", "--model", "unused-by-openai-configs", "--configs", f"{large},{group}",
                   "--trace", "text", "--num-requests", "16", "--interactive-share", "0.75", "--send-classes",
                   "--seed", "3", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    trace = load_trace(out / "trace.jsonl")
    classes = Counter(r.latency_class for r in trace)
    assert classes["interactive"] > classes["batch"] > 0
    assert len(GroupServer.seen) == 32 and {b["model"] for b in GroupServer.seen} == {"llava", "llava-large"}
    sent = sorted((b["model"], b["latency_class"], b["priority"]) for b in GroupServer.seen)
    assert sent == sorted((m, r.latency_class, r.priority) for m in ("llava", "llava-large") for r in trace)

    data = json.loads((out / "compare.json").read_text())
    only_large, grouped = data["summaries"][large], data["summaries"][group]
    assert only_large["served_models"] == {"llava-large": 16, "llava-small": 0}
    assert grouped["served_models"] == {"llava-large": classes["batch"], "llava-small": classes["interactive"]}
    assert grouped["interactive"]["served_models"] == {"llava-large": 0, "llava-small": classes["interactive"]}
    assert grouped["batch"]["served_models"] == {"llava-large": classes["batch"], "llava-small": 0}
    md = (out / "compare.md").read_text()
    n_i, n_b = classes["interactive"], classes["batch"]
    assert f"| interactive answered by llava-small | 0 | {n_i} |" in md
    assert f"| batch answered by llava-large | {n_b} | {n_b} (1.00x) |" in md
    assert f"| answered by llava-large | 16 | {n_b} ({n_b / 16:.2f}x) |" in md
    assert "| interactive TTFT p99 ms |" in md and "interactive share 0.75" in md
    (run_dir,) = out.glob("1-*")
    per_run = json.loads((run_dir / "results.json").read_text())
    assert per_run["meta"]["http_model"] == "llava" and per_run["meta"]["send_classes"] is True
    assert {r["served_model"] for r in per_run["records"]} == {"llava-small", "llava-large"}
    assert set(per_run["summary"]["by_class"]["served_model"]) == {"llava-small", "llava-large"}


def test_openai_configs_take_the_model_their_requests_name() -> None:
    spec = parse_config("openai:http://h:8000/v1@model=llava")
    assert spec == ConfigSpec("openai:http://h:8000/v1@model=llava", "http", url="http://h:8000/v1",
                              request_model="llava")
    assert parse_config("openai:http://h:8000/v1").request_model is None
    for bad, match in (("openai:http://h/v1@model=a@model=b", "takes one setting, @model=NAME"),
                       ("openai:http://h/v1@max-num-seqs=2", "takes one setting, @model=NAME"),
                       ("zmq://h:5555@model=llava", "@model=NAME to openai:"),
                       ("hf-sequential@model=x", "@model=NAME to openai:")):
        with pytest.raises(ValueError, match=match):
            parse_config(bad)


def test_classes_travel_in_the_http_body_only_when_asked() -> None:
    req = make_trace("text", 1, seed=0, interactive_share=0.0)[0]
    assert "latency_class" not in build_payload("m", req) and "priority" not in build_payload("m", req)
    body = build_payload("m", req, classes=True)
    assert body["latency_class"] == "batch" and body["priority"] == req.priority


def test_the_interactive_share_flag_sets_the_class_mix() -> None:
    from mserve.bench.serve import build_trace

    def share(*flags: str) -> float:
        args = build_parser().parse_args(["bench", "serve", "--target", "zmq://h:1", "--trace", "text",
                                          "--num-requests", "400", *flags])
        trace = build_trace(args)
        return sum(r.latency_class == "interactive" for r in trace) / len(trace)

    assert share() == pytest.approx(0.5, abs=0.08)
    assert share("--interactive-share", "0.9") == pytest.approx(0.9, abs=0.05)
    assert share("--interactive-share", "0") == 0.0 and share("--interactive-share", "1") == 1.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--target", "zmq://h:1", "--interactive-share", "1.5"])


def test_summaries_count_the_served_model_and_group_by_it_only_when_known() -> None:
    def rec(i: int, model: str | None, cls: str = "interactive", error: str | None = None) -> RequestRecord:
        return RequestRecord(request_id=f"r{i}", latency_class=cls, start_s=0.0, first_token_s=0.1, end_s=0.2,
                             token_times_s=[0.1, 0.2], output_tokens=2, served_model=model, error=error)

    records = [rec(0, "small"), rec(1, "small"), rec(2, "large", "batch"), rec(3, None, error="boom")]
    s = summarize(records, 1.0)
    assert s["overall"]["served_models"] == {"large": 1, "small": 2}  # completed requests only
    assert set(s["by_class"]["served_model"]) == {"large", "small", "unknown"}
    assert s["by_class"]["served_model"]["unknown"]["failed"] == 1
    assert s["by_class"]["latency_class"]["batch"]["served_models"] == {"large": 1}
    plain = summarize([rec(0, None)], 1.0)
    assert "served_model" not in plain["by_class"] and plain["overall"]["served_models"] == {}


def test_served_model_rows_fill_zeros_and_add_no_rows_without_a_routed_choice() -> None:
    rows = [("a", {"served_models": {"x": 3, "y": 2}, "interactive": {"served_models": {"x": 2}}, "batch": {}}),
            ("b", {"served_models": {"y": 1}, "interactive": {}, "batch": {"served_models": {"y": 1}}}), ("failed", {})]
    filled, metrics = served_model_rows(rows)
    assert filled[1][1]["served_models"] == {"x": 0, "y": 1} and filled[1][1]["interactive"]["served_models"] == {
        "x": 0, "y": 0}
    assert filled[2] == ("failed", {}) and rows[1][1]["served_models"] == {"y": 1}  # the input is left alone
    assert [m[0] for m in metrics] == ["answered by x", "answered by y", "interactive answered by x",
                                       "interactive answered by y", "batch answered by x", "batch answered by y"]
    assert metrics[3][1] == ("interactive", "served_models", "y")
    plain = [("a", {"served_models": {}})]
    assert served_model_rows(plain) == (plain, [])
    # Each configuration answered by its one model (vLLM's served name, MServe's path): no rows of zeros.
    one_each = [("openai", {"served_models": {"llava": 100}}), ("unified:1", {"served_models": {"/m/llava": 100}})]
    assert served_model_rows(one_each) == (one_each, [])


def test_a_zmq_result_names_its_model_only_when_it_carries_one() -> None:
    res = Result(request_id="r", token_ids=[1], text="x", finish_reason="stop", timings={})
    assert served_model(res) is None  # a single-model coordinator's RESULT names no model

    class Named:
        model = "llava-small"

    assert served_model(Named()) == "llava-small"
