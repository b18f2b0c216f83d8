"""`mserve bench serve`: the load generator's scheduling (fake target) and a real run against a tiny cluster."""

from __future__ import annotations

import asyncio
import io
import json
import math
import time

import pytest
from PIL import Image

from mserve.bench.serve import drive, parse_slo
from mserve.bench.traces import load_trace, make_trace, trace_digest
from mserve.cli import main as cli_main
from tests.clusters import LLAVA_1E1P1D

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeTarget:
    """Answers every request after `delay_s` with `tokens` tokens; logs (request_id, start, end)."""

    def __init__(self, delay_s: float = 0.02, tokens: int = 3) -> None:
        self.delay_s, self.tokens = delay_s, tokens
        self.log: list[tuple[str, float, float]] = []
        self.in_flight = self.max_in_flight = 0

    def prepare(self, req):
        return None

    async def run(self, req, prepared, rec) -> None:
        rec.start_s = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        now = time.perf_counter()
        rec.token_times_s = [now] * self.tokens
        rec.first_token_s, rec.end_s, rec.output_tokens = now, now, self.tokens
        self.log.append((req.request_id, rec.start_s, now))


def test_parse_slo() -> None:
    assert parse_slo("ttft=500, tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("") == {}
    with pytest.raises(Exception):
        parse_slo("ttft")


def test_drive_keeps_schedule_and_reports_lag() -> None:
    trace = make_trace("text", 40, seed=1, rate=200.0, max_tokens=3, prompt_tokens=4)
    target = FakeTarget(delay_s=0.01)
    records, lg = asyncio.run(drive(target, trace))
    assert [r.request_id for r in records] == [r.request_id for r in trace]
    t0 = min(r.scheduled_s - q.arrival_s for r, q in zip(records, trace))
    for rec, req in zip(records, trace):
        assert rec.ok and rec.output_tokens == 3
        assert rec.scheduled_s == pytest.approx(t0 + req.arrival_s, abs=1e-6)
        assert rec.start_s >= rec.scheduled_s and rec.dispatch_lag_s == pytest.approx(rec.start_s - rec.scheduled_s)
    assert lg["requests"] == 40 and lg["offered_rate"] == pytest.approx(200.0, rel=0.05)
    assert lg["dispatch_lag_ms"]["p50"] < 20  # generous: a loaded 2-core CI machine
    assert lg["achieved_send_rate"] == pytest.approx(200.0, rel=0.3)


def test_drive_multiturn_waits_for_previous_turn_and_caps_concurrency() -> None:
    trace = make_trace("multiturn", 12, seed=3, rate=math.inf, max_tokens=2, prompt_tokens=4,
                       resolutions=[((32, 32), 1.0)])
    target = FakeTarget(delay_s=0.02)
    records, _ = asyncio.run(drive(target, trace, max_concurrency=3))
    assert all(r.ok for r in records)
    assert target.max_in_flight <= 3
    span = {rid: (start, end) for rid, start, end in target.log}
    by_turn = {(q.conversation_id, q.turn): q.request_id for q in trace}
    chained = 0
    for q in trace:
        if q.turn > 0:
            prev = by_turn[(q.conversation_id, q.turn - 1)]
            assert span[q.request_id][0] >= span[prev][1], f"{q.request_id} sent before {prev} finished"
            chained += 1
    assert chained > 0


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


@pytest.mark.slow
@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], ids=str, indirect=True)
def test_bench_serve_against_a_tiny_cluster(shared_cluster, tmp_path) -> None:
    out, replay = tmp_path / "run", tmp_path / "replay"
    common = ["--rate", "inf", "--warmup", "1", "--no-progress", "--slo", "ttft=60000,tpot=60000"]
    target = shared_cluster.address.replace("tcp://", "zmq://")
    rc = cli_main(["bench", "serve", "--target", target, "--trace", "mixed", "--num-requests", "12", "--seed", "5",
                   "--max-tokens", "8", "--resolutions", "64x64,200x150", "--out", str(out), *common])
    assert rc == 0
    rc = cli_main(["bench", "serve", "--target", target, "--trace-file", str(out / "trace.jsonl"),
                   "--max-tokens", "8", "--no-plots", "--out", str(replay), *common])
    assert rc == 0

    results = json.loads((out / "results.json").read_text())
    meta, overall, records = results["meta"], results["summary"]["overall"], results["records"]
    trace = load_trace(out / "trace.jsonl")
    assert len(trace) == 12 and meta["trace_digest"] == trace_digest(trace)
    assert meta["num_requests"] == 12 and meta["rate"] == "inf"
    assert overall["count"] == 12 and overall["completed"] == 12 and overall["failed"] == 0 and not overall["errors"]
    assert len(records) == 12 and {r["request_id"] for r in records} == {q.request_id for q in trace}
    assert overall["good_requests"] == 12
    modality = {q.request_id: q.modality for q in trace}
    assert {"text", "image"} <= set(modality.values())
    for rec in records:
        assert rec["error"] is None and rec["modality"] == modality[rec["request_id"]]
        # output_tokens is what the cluster returned; every returned token was timestamped on arrival.
        assert 1 <= rec["output_tokens"] == len(rec["token_times_s"]) <= 8
        if rec["finish_reason"] == "length":
            assert rec["output_tokens"] == 8
        else:
            assert rec["finish_reason"] == "stop"
        assert rec["start_s"] <= rec["first_token_s"] == rec["token_times_s"][0] <= rec["end_s"]
        assert rec["token_times_s"] == sorted(rec["token_times_s"])
        assert rec["prompt_tokens"] > 0 and rec["timings"]["total_s"] > 0
        if rec["modality"] == "image":
            assert rec["visual_tokens"] > 0 and rec["timings"]["encode_s"] > 0
        else:
            assert rec["visual_tokens"] == 0
    assert overall["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    assert meta["loadgen"]["requests"] == 12 and meta["loadgen"]["dispatch_lag_ms"]["max"] >= 0
    counts = meta["loadgen"]["server_counts"]  # the coordinator's counters gained over the 12, warmup excluded
    assert counts["admitted"] == counts["completed"] == 12 and counts["reruns"] == 0
    assert set(results["summary"]["stage_timings_ms"]) >= {"all", "text", "image"}
    report = (out / "report.md").read_text()
    assert "## Load generator" in report and "## Cluster stage timings" in report
    assert "The server's own counts over the trace: admitted 12, completed 12" in report
    for name in ("latency_cdf.png", "throughput.png"):
        _check_png(out / name)

    # The replay sent the byte-identical trace and got the same output lengths (greedy, same cluster).
    again = json.loads((replay / "results.json").read_text())
    assert again["meta"]["trace_digest"] == meta["trace_digest"]
    assert again["summary"]["overall"]["completed"] == 12
    lengths = {r["request_id"]: r["output_tokens"] for r in records}
    assert {r["request_id"]: r["output_tokens"] for r in again["records"]} == lengths
    assert not list(replay.glob("*.png"))
