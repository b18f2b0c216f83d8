"""The one interface `mserve bench serve` drives, and the factory that picks a target from a URL.

A target is one way of sending a TraceRequest to a server and timing its tokens. The load generator
(mserve.bench.serve.drive / run_trace) uses a target only through ``Target``:

* ``open()`` / ``close()`` bracket a run (connect and disconnect; both may do nothing);
* ``prepare(req)`` does per-request work that must not count as latency (the ZeroMQ target builds
  the request body there); drive() calls it for every request of the trace before the first send,
  and passes what it returns to ``run``;
* ``run(req, prepared, rec)`` sends the request and fills ``rec`` (a mserve.bench.metrics.RequestRecord
  or subclass): ``start_s`` right before sending, ``first_token_s`` and ``token_times_s`` as tokens
  arrive, ``end_s``, token counts and cache hits. It never raises for a failed request: it sets
  ``rec.error`` and ``rec.error_type`` instead.

Implementations: ZmqTarget (mserve.bench.zmq_target, an MServe coordinator over ZeroMQ) and
HttpTarget (mserve.bench.http_target, an OpenAI-compatible server). Only stdlib here, so that
`mserve --help` stays light; each target's module is imported when it is made.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Target(Protocol):
    """Any object with these four methods is a target; subclass it to inherit the no-op defaults."""

    async def open(self) -> None:
        """Get ready to send (connect); called once before the first prepare/run. Default: nothing."""

    async def close(self) -> None:
        """Release what open() took; called once after the last run, also on failure. Default: nothing."""

    def prepare(self, req: Any) -> Any:
        """Per-request work done before the clock starts; the value is passed to run(). Default: None."""
        return None

    async def run(self, req: Any, prepared: Any, rec: Any) -> None:
        """Send one request and record its timings into ``rec``; failures go into rec.error."""
        raise NotImplementedError

    async def counters(self) -> dict[str, int] | None:
        """The server's own running counts (an MServe coordinator's re-runs, prompts lent to decode...),
        read before and after the measured requests; None where the target has none. Default: None."""
        return None


ZMQ_SCHEMES = ("zmq://", "tcp://", "ipc://", "redis://", "rediss://")  # redis: the shards' registry
HTTP_SCHEMES = ("http://", "https://")


def make_target(url: str, model: str | None, *, ignore_eos: bool, timeout_s: float,
                send_classes: bool = False) -> Target:
    """ZmqTarget for zmq:// (tcp://, ipc://) URLs, HttpTarget for http(s)://; SystemExit otherwise.
    `send_classes`: an HttpTarget sends each request's priority and latency_class (a ZmqTarget always does)."""
    if url.startswith(ZMQ_SCHEMES):
        from mserve.bench.zmq_target import ZmqTarget

        return ZmqTarget(url, ignore_eos=ignore_eos, timeout_s=timeout_s)
    if url.startswith(HTTP_SCHEMES):
        if not model:
            raise SystemExit("error: --model NAME is required for an HTTP target")
        from mserve.bench.http_target import HttpTarget

        return HttpTarget(url, model, ignore_eos=ignore_eos, timeout_s=timeout_s, send_classes=send_classes)
    raise SystemExit(f"error: --target {url!r}: expected zmq://HOST:PORT or http://HOST:PORT/v1")
