"""A request's spans at the coordinator: the request, its admission, each stage's queue wait and run.

The request machine calls these at the points it already passes (submit, a stage sent, a stage done,
a re-run, the end); they only record. With tracing off (common/tracing.py) a request has no
RequestTrace at all, so the machine pays one `is None` test per point.
"""

from __future__ import annotations

from typing import Any

from mserve.common import tracing


class RequestTrace:
    """The open spans of one request: the request span, and the span of the stage it is in."""

    def __init__(self, parent: str | None, attributes: dict[str, Any], admission_s: float) -> None:
        start = tracing.ns_ago(admission_s)
        self.stage: Any = None
        self.request = tracing.start("request", parent, start_ns=start, attributes=attributes)
        if not self.request.is_recording():
            return
        tracing.record("admission", self.request, start, attributes={"mserve.prompt_tokens": attributes.get(
            "mserve.prompt_tokens"), "mserve.images": attributes.get("mserve.images")})

    @classmethod
    def begin(cls, *, parent: str | None, request_id: str, client_rid: str, prompt_tokens: int,
              visual_tokens: int, images: int, latency_class: str, admission_s: float) -> RequestTrace | None:
        """The request's trace, or None while tracing is off."""
        if not tracing.enabled():
            return None
        trace = cls(parent, {"mserve.request_id": client_rid, "mserve.coordinator_rid": request_id,
                             "mserve.prompt_tokens": prompt_tokens, "mserve.visual_tokens": visual_tokens,
                             "mserve.images": images, "mserve.latency_class": latency_class}, admission_s)
        if not trace.request.is_recording():  # not sampled (OTEL_TRACES_SAMPLER): nothing more to record
            tracing.end(trace.request)
            return None
        return trace

    def stage_sent(self, stage: str, workers: list[str], attempt: int, queued_s: float) -> str | None:
        """The request left the coordinator's queue for `stage` on `workers`: the queue span, and the
        stage span's traceparent for the stage message (the worker's spans go under it)."""
        self.stage_ended()  # a spread encode's last parts may still run when its prefill goes out
        tracing.record(f"{stage}.queue", self.request, tracing.ns_ago(queued_s))
        self.stage = tracing.start(stage, self.request, attributes={"mserve.workers": ",".join(workers),
                                                                    "mserve.attempt": attempt})
        return tracing.traceparent(self.stage)

    def stage_ended(self, attributes: dict[str, Any] | None = None, error: str | None = None) -> None:
        span, self.stage = self.stage, None
        tracing.end(span, attributes=attributes, error=error)

    def finish(self, attributes: dict[str, Any], error: str | None = None) -> None:
        self.stage_ended(error=error)
        tracing.end(self.request, attributes=attributes, error=error)
