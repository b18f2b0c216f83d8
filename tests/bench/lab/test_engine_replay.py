"""lab.engine_replay runs a bench trace's requests (text and image) through one engine to the end."""

from __future__ import annotations

import base64
import json

from lab.engine_replay import main
from tests.helpers import make_image


def test_replays_text_and_image_requests(tiny_model_dirs, tmp_path, capsys):
    image = {"type": "image", "image": {"__bytes_b64__": base64.b64encode(make_image(120, 90, seed=1)).decode()}}
    rows = [[{"type": "text", "text": "Hello there"}], [{"type": "text", "text": "What is this?"}, image]]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n" for c in rows))
    assert main(["--model", str(tiny_model_dirs["llava"]), "--trace", str(trace), "--requests", "2",
                 "--concurrency", "2", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 requests") and "encode:" in out and "prefill steps:" in out
