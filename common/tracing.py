"""One request, one trace: OpenTelemetry spans from the gateway, the coordinator and each worker (off by default).

Each process calls `configure(service, endpoint)` once when it starts. Tracing is on when an OTLP/HTTP
endpoint is given (`--otlp-endpoint`) or one of the standard variables OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT is set, unless OTEL_SDK_DISABLED=true. Spans then leave the process from the
SDK's batch thread (OTEL_BSP_* variables tune it); nothing on a request's path waits for an export.
Off, every function here returns at its first line and the OpenTelemetry packages are never imported.

A span's context crosses processes as a W3C `traceparent` string: an HTTP client's header to the gateway,
GENERATE's `trace` field to the coordinator, each stage message's `trace` field to its worker. The span
tree of one request (docs/operations.md, "Tracing"):

    gateway: POST /v1/chat/completions
      coordinator: request                       (admission to result; cache hits as attributes)
        admission, <stage>.queue, <stage>        (encode / prefill / decode, or run on a unified worker)
          worker: <role>                         (the stage's time on the worker)
            encode.preprocess, encode.compute, embedding.transfer, kv.transfer
"""

from __future__ import annotations

import os
import time
from typing import Any

_tracer: Any = None  # the process's tracer while tracing is on
_provider: Any = None


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the OpenTelemetry SDK is not installed (the `trace` extra)."""


def endpoint_from_env() -> str | None:
    """The OTLP traces endpoint the standard variables name, or None (OTEL_SDK_DISABLED wins)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def configure(service: str, endpoint: str | None = None, *, exporter: Any = None,
              attributes: dict[str, Any] | None = None) -> bool:
    """Turn tracing on for this process when an endpoint (or `exporter`, a SpanExporter) is given or the
    environment names one; True when on. `service` becomes the spans' service.name."""
    global _tracer, _provider
    shutdown()
    endpoint = endpoint or (None if exporter is not None else endpoint_from_env())
    if endpoint is None and exporter is None:
        _tracer = None
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(f"tracing needs the OpenTelemetry SDK: pip install 'mserve[trace]' ({exc})") from exc
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service, **(attributes or {})}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("mserve")
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Export what is still buffered (a process about to exit), then stop tracing."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


def now_ns() -> int:
    """Span timestamps are wall-clock nanoseconds (processes on several hosts share one time line)."""
    return time.time_ns()


def ns_ago(seconds: float) -> int:
    return time.time_ns() - int(seconds * 1e9)


def _context(parent: Any) -> Any:
    """The OpenTelemetry context of `parent`: a span of this process, or a W3C traceparent string from
    another (parsed here: a quarter of the propagator's cost). None, or a string that does not parse,
    starts a new trace."""
    if not parent:
        return None
    from opentelemetry import trace

    if not isinstance(parent, str):
        return trace.set_span_in_context(parent)
    parts = parent.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    ctx = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags & 1))
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def start(name: str, parent: Any = None, *, start_ns: int | None = None,
          attributes: dict[str, Any] | None = None, kind: str = "internal") -> Any:
    """A span that runs from now (or `start_ns`) until `end` is called on it; None while tracing is off.
    `parent`: a span of this process or a traceparent string (None: a new trace). `kind`: "internal" or
    "server"."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent), start_time=start_ns,
                              attributes=_clean(attributes),
                              kind=SpanKind.SERVER if kind == "server" else SpanKind.INTERNAL)


def end(span: Any, *, end_ns: int | None = None, attributes: dict[str, Any] | None = None,
        error: str | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def record(name: str, parent: Any, start_ns: int, end_ns: int | None = None, *,
           attributes: dict[str, Any] | None = None, error: str | None = None) -> Any:
    """A span that already happened (its times measured meanwhile); the span, to parent others."""
    if _tracer is None:
        return None
    span = start(name, parent, start_ns=start_ns, attributes=attributes)
    end(span, end_ns=end_ns, error=error)
    return span


def traceparent(span: Any) -> str | None:
    """The W3C traceparent of `span` (what a child in another process is started under)."""
    if span is None:
        return None
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenTelemetry takes str / bool / int / float attribute values (None ones are left out)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def add_argument(p: Any) -> None:
    """`--otlp-endpoint`, the same on every command that runs a process of the cluster."""
    p.add_argument("--otlp-endpoint",
                   help="send one OpenTelemetry trace per request (spans from every process it passes) to this "
                        "OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces; default: the standard "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, else tracing is off "
                        "(needs pip install 'mserve[trace]')")
