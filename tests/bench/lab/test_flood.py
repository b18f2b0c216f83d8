"""The flood trace (python -m lab.flood): a batch flood with an interactive trickle."""

from __future__ import annotations

from lab.flood import flood_trace


def test_flood_trace_mixes_classes_at_their_rates():
    trace = flood_trace("text", batch_rate=3.0, interactive_rate=0.2, duration_s=20, seed=1, max_tokens=4)
    batch = [r for r in trace if r.latency_class == "batch"]
    inter = [r for r in trace if r.latency_class == "interactive"]
    assert (len(batch), len(inter)) == (60, 4)
    assert all(r.request_id.startswith("b") for r in batch) and all(r.request_id.startswith("i") for r in inter)
    assert all(r.priority == 0 for r in trace) and len({r.request_id for r in trace}) == 64
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert max(r.arrival_s for r in inter) <= 20.0 + 1e-9
