"""common/tracing.py and the coordinator's request spans, in one process (the SDK's in-memory exporter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mserve.common import tracing
from mserve.coordinator.tracing import RequestTrace


@pytest.fixture
def exporter():
    """Tracing on in this process into the SDK's in-memory exporter; its spans are read after shutdown()."""
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", exporter=exporter)
    yield exporter
    tracing.shutdown()


def test_off_by_default_and_without_opentelemetry_imported(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    code = ("import sys; from mserve.common import tracing; from mserve.coordinator.tracing import RequestTrace; "
            "on = tracing.configure('x'); t = RequestTrace.begin(parent=None, request_id='r', client_rid='c', "
            "prompt_tokens=1, visual_tokens=0, images=0, latency_class='batch', admission_s=0.0); "
            "print(on, t, tracing.start('s'), tracing.record('s', None, 0), "
            "any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None", "None", "None", "False"]


def test_the_standard_variables_choose_the_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert tracing.endpoint_from_env() == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:4318/v1/traces")
    assert tracing.endpoint_from_env() == "http://other:4318/v1/traces"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.endpoint_from_env() is None


def test_a_request_trace_continues_the_callers_and_nests_its_stages(exporter):
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    t = RequestTrace.begin(parent=caller, request_id="r1", client_rid="c1", prompt_tokens=30, visual_tokens=20,
                           images=1, latency_class="interactive", admission_s=0.002)
    assert t is not None
    tp = t.stage_sent("encode", ["encode-0"], 0, queued_s=0.01)
    assert tp is not None and tp.split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    tracing.record("encode worker", tp, tracing.ns_ago(0.005))
    t.stage_ended()
    t.stage_sent("prefill", ["prefill-0"], 0, queued_s=0.0)
    t.finish({"mserve.attempts": 1}, error="internal: boom")  # the open stage ends with the request
    tracing.shutdown()  # flushes the batch processor
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    request = by_name["request"]
    assert format(request.parent.span_id, "016x") == "00f067aa0ba902b7"
    for name in ("admission", "encode.queue", "encode", "prefill.queue", "prefill"):
        assert by_name[name].parent.span_id == request.context.span_id, name
    assert by_name["encode worker"].parent.span_id == by_name["encode"].context.span_id
    assert not request.status.is_ok and not by_name["prefill"].status.is_ok and by_name["encode"].status.is_ok
    assert by_name["encode.queue"].end_time - by_name["encode.queue"].start_time >= 9_000_000  # ~10 ms queued


def test_a_malformed_traceparent_starts_a_new_trace(exporter):
    tracing.record("request", "not-a-traceparent", tracing.now_ns())
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 0


def test_an_unsampled_request_records_nothing_past_its_first_span(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # sample nothing new
    exporter = InMemorySpanExporter()
    tracing.configure("test", exporter=exporter)
    try:
        kw = dict(request_id="r", client_rid="c", prompt_tokens=1, visual_tokens=0, images=0,
                  latency_class="batch", admission_s=0.0)
        assert RequestTrace.begin(parent=None, **kw) is None  # the coordinator then sends no trace to workers
        sampled = RequestTrace.begin(parent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", **kw)
        assert sampled is not None  # a caller that sampled its trace keeps it sampled (parent-based)
        sampled.finish({})
    finally:
        tracing.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["admission", "request"]
