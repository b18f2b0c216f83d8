"""lab.engine_replay runs a bench trace's requests (text and image) through one engine to the end."""

from __future__ import annotations

import json
import re

from lab.engine_replay import main
from mserve.bench.traces import TraceRequest, request_to_dict
from tests.helpers import make_image


def test_replays_text_and_image_requests(tiny_model_dirs, tmp_path, capsys):
    image = {"type": "image", "image": make_image(120, 90, seed=1)}
    rows = [[{"type": "text", "text": "Hello there"}], [{"type": "text", "text": "What is this?"}, image]]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(request_to_dict(TraceRequest(f"r{i}", 0.0, [{"role": "user", "content": c}],
                                                                     3, "text"))) + "\n"
                             for i, c in enumerate(rows)))
    assert main(["--model", str(tiny_model_dirs["llava"]), "--trace", str(trace), "--requests", "2",
                 "--concurrency", "2", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 requests") and "encode:" in out and "prefill steps:" in out
    assert re.search(r"prefill steps: .* per request \((\d+) steps, [\d,]+ prompt tokens a step\)", out), out
    assert re.search(r"decode-only steps: .* per request \(\d+ steps, [\d.]+ ms a step\)", out), out
