"""Metric definitions checked against hand-made timelines with known answers."""

from __future__ import annotations

import json

import pytest

from mserve.bench.metrics import RequestRecord, run_duration, summarize


def rec(rid: str, ttft_ms: float, token_gaps_ms: list[float], *, start: float = 10.0, **kw) -> RequestRecord:
    first = start + ttft_ms / 1000
    times = [first]
    for gap in token_gaps_ms:
        times.append(times[-1] + gap / 1000)
    return RequestRecord(
        request_id=rid, start_s=start, first_token_s=first, token_times_s=times, end_s=times[-1],
        output_tokens=len(times), prompt_tokens=kw.pop("prompt_tokens", 10), **kw,
    )


def three() -> list[RequestRecord]:
    return [
        rec("a", 100, [10, 10, 10], modality="text"),  # e2e 130, tpot 10
        rec("b", 200, [20, 20, 20], modality="image"),  # e2e 260, tpot 20
        rec("c", 300, [30, 30, 30], modality="image", priority=2),  # e2e 390, tpot 30
    ]


def test_known_percentiles_and_means() -> None:
    s = summarize(three(), duration_s=2.0)["overall"]
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["ttft_ms"]["p90"] == pytest.approx(280)  # linear interpolation between 200 and 300
    assert s["tpot_ms"]["p50"] == pytest.approx(20)
    assert s["e2e_ms"]["mean"] == pytest.approx(260)
    # ITL pools every gap of every request: 10,10,10,20,20,20,30,30,30
    assert s["itl_ms"]["p50"] == pytest.approx(20)
    assert s["itl_ms"]["mean"] == pytest.approx(20)
    assert s["completed"] == 3 and s["failed"] == 0
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(12 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((12 + 30) / 2.0)


def test_tpot_uses_e2e_minus_ttft_over_tokens_minus_one() -> None:
    # 5 tokens reported but only 3 chunks arrived (e.g. multi-token chunks): TPOT follows the formula.
    r = rec("x", 50, [40, 40])
    r.output_tokens = 5
    r.end_s = r.token_times_s[-1] + 0.02  # stream ends 20 ms after the last chunk
    assert r.tpot_s == pytest.approx((0.05 + 0.08 + 0.02 - 0.05) / 4)
    assert r.itls_s == pytest.approx([0.04, 0.04])


def test_goodput_counts_requests_meeting_every_slo() -> None:
    recs = three()
    s = summarize(recs, duration_s=2.0, slos={"ttft": 250, "tpot": 25})["overall"]
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    # limits are inclusive, like vLLM
    assert summarize(recs, 2.0, {"e2el": 260})["overall"]["good_requests"] == 2
    # ITL SLO is per request on its longest gap
    assert summarize(recs, 2.0, {"itl": 20})["overall"]["good_requests"] == 2
    with pytest.raises(ValueError):
        summarize(recs, 2.0, {"latency": 1})


def test_errors_counted_by_type_and_excluded_from_latency() -> None:
    recs = three() + [
        RequestRecord("e1", start_s=0, end_s=0.5, error="HTTP 400: bad", error_type="HTTPError"),
        RequestRecord("e2", start_s=0, end_s=0.5, error="HTTP 500", error_type="HTTPError"),
        RequestRecord("e3", start_s=0, error="refused", error_type="ConnectionRefusedError"),
        # a failure mid-stream still has timings, which must not leak into the stats
        rec("e4", 5000, [5000], error="cut", error_type="IncompleteStream"),
    ]
    s = summarize(recs, duration_s=2.0, slos={"ttft": 1e9})["overall"]
    assert s["count"] == 7 and s["completed"] == 3 and s["failed"] == 4
    assert s["errors"] == {"ConnectionRefusedError": 1, "HTTPError": 2, "IncompleteStream": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["e2e_ms"]["p99"] < 400
    assert s["good_requests"] == 3


def test_per_class_breakdown() -> None:
    s = summarize(three(), duration_s=2.0)
    by_mod = s["by_class"]["modality"]
    assert set(by_mod) == {"text", "image"}
    assert by_mod["image"]["count"] == 2 and by_mod["image"]["ttft_ms"]["p50"] == pytest.approx(250)
    assert by_mod["text"]["request_throughput"] == pytest.approx(0.5)
    assert list(s["by_class"]["priority"]) == ["0", "2"]
    assert s["by_class"]["latency_class"]["interactive"]["count"] == 3
    json.dumps(s)  # JSON-safe


def test_edge_cases_zero_completed_and_single_token() -> None:
    s = summarize([RequestRecord("e", error="x", error_type="Timeout")], duration_s=1.0, slos={"tpot": 5})["overall"]
    assert s["completed"] == 0 and s["ttft_ms"]["p50"] is None and s["goodput"] == 0.0
    assert summarize([], duration_s=0.0)["overall"]["request_throughput"] is None

    single = rec("s", 80, [])  # one output token: TTFT and E2E exist, TPOT and ITL do not
    s = summarize([single], duration_s=1.0, slos={"tpot": 1, "itl": 1})["overall"]
    assert s["tpot_ms"]["mean"] is None and s["itl_ms"]["p50"] is None
    assert s["ttft_ms"]["p50"] == pytest.approx(80)
    assert s["good_requests"] == 1  # no TPOT passes the TPOT SLO, as in vLLM


def test_cache_hit_rates_aggregate_hits_over_lookups() -> None:
    recs = three()
    recs[0].cache_hits = {"prefix": (30, 100), "encoder": 1}
    recs[1].cache_hits = {"prefix": (70, 100), "encoder": 0}
    s = summarize(recs, 1.0)["overall"]
    assert s["cache_hit_rate"] == {"encoder": pytest.approx(0.5), "prefix": pytest.approx(0.5)}


def test_run_duration() -> None:
    assert run_duration(three()) == pytest.approx(0.39)
    assert run_duration([]) == 0.0
