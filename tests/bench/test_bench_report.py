"""Report files: results.json content, markdown tables, PNG plots, comparison table."""

from __future__ import annotations

import importlib.util
import json

import pytest
from PIL import Image

from mserve.bench.metrics import RequestRecord, summarize
from mserve.bench.report import compare_table, write_report
from mserve.bench.traces import make_trace, trace_digest

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def records() -> list[RequestRecord]:
    out = []
    for i, mod in enumerate(["text", "image", "image", "multi-image"]):
        start = 0.5 * i
        times = [start + 0.1 + 0.02 * k for k in range(5)]
        out.append(RequestRecord(f"r{i}", mod, priority=i % 2, start_s=start, first_token_s=times[0],
                                 token_times_s=times, end_s=times[-1], prompt_tokens=20, output_tokens=5))
    out.append(RequestRecord("bad", "text", start_s=0.1, end_s=0.2, error="HTTP 400: no", error_type="HTTPError"))
    return out


def test_write_report(tmp_path) -> None:
    recs = records()
    trace = make_trace("text", 5, seed=1)
    summary = summarize(recs, duration_s=2.0, slos={"ttft": 150})
    paths = write_report(tmp_path / "run", recs, summary, {"target": "http://x/v1", "model": "m"}, trace=trace)

    results = json.loads(paths["results"].read_text())
    assert results["meta"]["trace_digest"] == trace_digest(trace)
    assert "command_line" in results["meta"] and results["meta"]["model"] == "m"
    assert len(results["records"]) == 5 and results["records"][4]["error_type"] == "HTTPError"
    assert results["summary"]["overall"]["completed"] == 4

    md = paths["report"].read_text()
    assert "| TTFT p50 ms |" in md and "## By modality" in md and "| multi-image |" in md
    assert "HTTPError: 1" in md and "goodput" in md

    if HAS_MPL:
        for key in ("latency_cdf", "throughput"):
            data = paths[key].read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            with Image.open(paths[key]) as img:
                img.verify()
    else:
        assert "latency_cdf" not in paths


def test_report_with_no_completed_requests(tmp_path) -> None:
    recs = [RequestRecord("bad", error="refused", error_type="ConnectionRefusedError")]
    paths = write_report(tmp_path, recs, summarize(recs, 0.0), {}, plots=HAS_MPL)
    assert "—" in paths["report"].read_text()


def test_compare_table_ratios() -> None:
    recs = records()
    fast = summarize(recs, duration_s=1.0)
    slow = summarize(recs, duration_s=2.0)
    table = compare_table([("mserve", fast), ("vllm", slow)])
    lines = table.splitlines()
    assert lines[0] == "| metric | mserve | vllm (vs mserve) |"
    row = next(line for line in lines if line.startswith("| req/s |"))
    assert "(0.50x)" in row
    assert any(line.startswith("| E2E p99 ms |") for line in lines)
    assert compare_table([]) == ""


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    recs = records()
    paths = write_report(tmp_path, recs, summarize(recs, 1.0), {"trace_digest": "x"})
    assert set(paths) == {"results", "report"}
