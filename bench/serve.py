"""`mserve bench serve`: replay a seeded trace against an MServe cluster (ZeroMQ) or an OpenAI-compatible server.

Arrivals follow the trace (Poisson/gamma at --rate, or all at once with --rate inf), optionally capped by
--max-concurrency; turn k+1 of a multiturn conversation waits for turn k to finish. One dispatcher task
sleeps to each arrival and spawns the request; every request records when it was actually sent, so the
generator's own dispatch lag (send time - the time it was due) is measured and reported in the meta.

Output (--out): trace.jsonl (replay it with --trace-file), results.json (meta, summary, per-request
records with per-stage timings from the cluster), report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mserve.bench.targets import Target, make_target

# Only stdlib at module level (targets.py included): `mserve --help` builds this module's parser. numpy,
# the targets' clients and the trace/metric modules are imported where used.



# --------------------------------------------------------------------------- flags


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf, got {text}")
    return rate


def parse_share(text: str) -> float:
    share = float(text)
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"share must be in [0, 1], got {text}")
    return share


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft=500,tpot=50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"SLO {item!r} is not NAME=MS")
        try:
            out[key.strip().lower()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"SLO {item!r}: {value!r} is not a number") from None
    return out


def parse_resolutions(text: str | None) -> list[tuple[tuple[int, int], float]] | None:
    """"224x224,640x480" -> equally weighted sizes; None keeps the trace's default mix."""
    if not text:
        return None
    sizes = []
    for item in text.split(","):
        w, _, h = item.strip().lower().partition("x")
        sizes.append(((int(w), int(h)), 1.0))
    return sizes


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """Trace and load flags shared by `bench serve` and `bench compare`."""
    p.add_argument("--trace", default="mixed", help="text, image, mixed, multi-image, multiturn, video "
                   "(4-8 frames per request), document (a 2-4 page PDF per request) or audio (a 1-8 s WAV clip per "
                   "request, for a model with an audio tower; default mixed)")
    p.add_argument("--trace-file", default=None, metavar="PATH", help="replay a saved trace.jsonl instead")
    p.add_argument("--num-requests", type=int, default=100, help="requests in the trace (default 100)")
    p.add_argument("--rate", type=parse_rate, default=math.inf, help="requests/s, or inf = all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson (default)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="words of text per user turn (default 64)")
    p.add_argument("--image-share", type=float, default=0.5,
                   help="share of requests (multiturn: conversations) with an image (mixed, multiturn; 0.5)")
    p.add_argument("--audio-share", type=parse_share, default=0.0, metavar="F",
                   help="mixed trace: share of requests that also carry an audio clip, for a model that takes "
                        "images and audio (default 0)")
    p.add_argument("--interactive-share", type=parse_share, default=0.5, metavar="F",
                   help="share of requests (multiturn: conversations) in latency class interactive, the rest "
                        "batch (default 0.5); the report and compare tables split by class")
    p.add_argument("--turns", type=int, default=None,
                   help="multiturn: turns per conversation (default: 2-4, drawn per conversation)")
    p.add_argument("--resolutions", default=None, metavar="WxH,...",
                   help="image sizes to draw from, equally weighted (default: the trace's realistic mix)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (fixed output lengths)")
    p.add_argument("--send-classes", action="store_true",
                   help="HTTP targets: send each request's priority and latency_class in the body (MServe's gateway "
                        "routes by them; a vLLM peer takes priority only with --scheduling-policy priority). "
                        "ZeroMQ targets always send them")
    p.add_argument("--slo", type=parse_slo, default={}, metavar="ttft=MS,tpot=MS",
                   help="SLOs for goodput: ttft, tpot, itl, e2e in ms")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests sent first (default 2)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="URL",
                   help="zmq://HOST:PORT (an MServe coordinator; sharded: comma-separated, or redis://... for "
                        "their registry) or http://HOST:PORT/v1 (OpenAI-compatible)")
    p.add_argument("--model", default=None, help="model name sent to an HTTP server (recorded for zmq)")
    add_load_arguments(p)
    p.add_argument("--out", default=None, help="output folder (default out/bench/serve-TRACE-TIME)")


# --------------------------------------------------------------------------- records


_RECORD_CLASS: Any = None


def record_class() -> Any:
    """mserve.bench.metrics.RequestRecord plus what a serving run adds (metrics and report take it as a RequestRecord).

    Built on first use so that importing this module (for the CLI's flags) stays free of numpy.
    """
    global _RECORD_CLASS
    if _RECORD_CLASS is None:
        from mserve.bench.metrics import RequestRecord

        @dataclass
        class ServeRecord(RequestRecord):
            scheduled_s: float = 0.0  # when it was due: its arrival, its previous turn's end, or a free slot
            dispatch_lag_s: float = 0.0  # start_s - scheduled_s: the generator's own delay
            finish_reason: str | None = None
            conversation_id: str | None = None
            turn: int = 0
            timings: dict[str, float] = field(default_factory=dict)  # the cluster's stage seconds (ZeroMQ)

        _RECORD_CLASS = ServeRecord
    return _RECORD_CLASS


def new_record(req: Any) -> Any:
    return record_class()(request_id=req.request_id, modality=req.modality, priority=req.priority,
                          latency_class=req.latency_class, conversation_id=req.conversation_id, turn=req.turn)


# --------------------------------------------------------------------------- the load generator


class Progress:
    """One stderr line: \\r-updated on a terminal, a plain line every 10 s otherwise."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.sent = self.done = self.failed = 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def line(self) -> str:
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        return (f"[{self.label}] [{'#' * filled}{'.' * (width - filled)}] sent {self.sent}/{self.total} "
                f"done {self.done} failed {self.failed} {time.perf_counter() - self.t0:6.1f}s")

    async def run(self) -> None:
        if not self.enabled:
            return
        period = 0.25 if self.tty else 10.0
        while True:
            await asyncio.sleep(period)
            sys.stderr.write(("\r" + self.line()) if self.tty else self.line() + "\n")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write(("\r" if self.tty else "") + self.line() + "\n")
            sys.stderr.flush()


async def drive(target: Target, trace: Sequence[Any], *, max_concurrency: int | None = None,
                progress: Progress | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Send the trace at its arrival times; return (records in trace order, load generator stats)."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    prepared = [target.prepare(req) for req in trace]  # message building happens before the clock starts
    records = [new_record(req) for req in trace]
    finished: dict[tuple[str, int], asyncio.Event] = {}
    ended_at: dict[tuple[str, int], float] = {}
    for req in trace:
        if req.conversation_id is not None:
            finished[(req.conversation_id, req.turn)] = asyncio.Event()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = progress or Progress(len(trace), "serve", enabled=False)

    async def one(i: int, due: float) -> None:
        req, rec = trace[i], records[i]
        key = (req.conversation_id, req.turn) if req.conversation_id is not None else None
        try:
            before = finished.get((req.conversation_id, req.turn - 1)) if key and req.turn > 0 else None
            if before is not None:
                await before.wait()  # turn k+1 goes out only once turn k has finished
                due = max(due, ended_at[(req.conversation_id, req.turn - 1)])
            if sem is not None:
                await sem.acquire()
                due = max(due, time.perf_counter())
            try:
                rec.scheduled_s = due
                progress.sent += 1
                await target.run(req, prepared[i], rec)
                rec.dispatch_lag_s = rec.start_s - due
            finally:
                if sem is not None:
                    sem.release()
        finally:
            progress.done += 1
            progress.failed += not rec.ok
            if key is not None:
                ended_at[key] = rec.end_s if rec.end_s is not None else time.perf_counter()
                finished[key].set()

    import gc

    gc.collect()
    gc.freeze()  # the trace's images and prepared bodies never die during the run: keep them out of GC scans
    ticker = asyncio.create_task(progress.run())
    tasks = []
    t0 = time.perf_counter()
    try:
        for i in order:
            due = t0 + trace[i].arrival_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        ticker.cancel()
        progress.finish()
        gc.unfreeze()
    return records, loadgen_stats(trace, records, t0)


def loadgen_stats(trace: Sequence[Any], records: Sequence[Any], t0: float) -> dict[str, Any]:
    """How well the generator kept to the schedule: dispatch lag percentiles and achieved send rate."""
    import numpy as np

    lags = np.asarray([r.dispatch_lag_s for r in records], dtype=float) * 1e3
    starts = sorted(r.start_s for r in records)
    trace_span = max((req.arrival_s for req in trace), default=0.0)
    out: dict[str, Any] = {"requests": len(records)}
    if len(lags):
        out["dispatch_lag_ms"] = {"p50": float(np.percentile(lags, 50)), "p90": float(np.percentile(lags, 90)),
                                  "p99": float(np.percentile(lags, 99)), "max": float(lags.max()),
                                  "mean": float(lags.mean())}
        out["late_over_10ms"] = int((lags > 10).sum())
    if len(starts) > 1:
        span = starts[-1] - starts[0]
        out["send_span_s"] = span
        out["achieved_send_rate"] = (len(starts) - 1) / span if span > 0 else None
    out["offered_rate"] = (len(trace) / trace_span) if trace_span > 0 else None
    out["first_send_after_s"] = (starts[0] - t0) if starts else None
    return out


async def _warmup(target: Target, n: int, max_tokens: int) -> None:
    """Untimed requests (text and image alternately) so first-call costs do not land in the run."""
    from mserve.bench.traces import make_trace

    for i in range(n):
        req = make_trace("text" if i % 2 == 0 else "image", 1, seed=10_000 + i, max_tokens=min(max_tokens, 8),
                         prompt_tokens=16, resolutions=[((336, 336), 1.0)])[0]
        req.request_id = f"warmup-{i}-{time.time_ns()}"
        await target.run(req, target.prepare(req), new_record(req))


async def run_trace(target: Target, trace: Sequence[Any], *, max_concurrency: int | None = None, warmup: int = 0,
                    max_tokens: int = 8, progress_label: str | None = "serve") -> tuple[list[Any], dict[str, Any]]:
    """Open the target, warm it up, drive the trace, close the target. The loadgen dict also carries
    "server_counts": what the target's own counters (Target.counters) gained over the trace, when it
    has them."""
    await target.open()
    try:
        await _warmup(target, warmup, max_tokens)
        before = await target.counters()
        progress = Progress(len(trace), progress_label or "", enabled=progress_label is not None)
        records, lg = await drive(target, trace, max_concurrency=max_concurrency, progress=progress)
        after = await target.counters() if before is not None else None
        if after is not None:
            lg["server_counts"] = {k: v - before.get(k, 0) for k, v in sorted(after.items())}
        return records, lg
    finally:
        await target.close()


# --------------------------------------------------------------------------- summaries and output


def build_trace(args: argparse.Namespace) -> list[Any]:
    from mserve.bench.traces import load_trace, make_trace

    if args.trace_file:
        return load_trace(args.trace_file)
    try:
        return make_trace(args.trace, args.num_requests, args.seed, rate=args.rate, burstiness=args.burstiness,
                          image_share=args.image_share, audio_share=getattr(args, "audio_share", 0.0),
                          interactive_share=getattr(args, "interactive_share", 0.5),
                          max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                          resolutions=parse_resolutions(args.resolutions), turns=getattr(args, "turns", None))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _extra_markdown(meta: dict[str, Any], stages: dict[str, Any]) -> str:
    lg = meta.get("loadgen", {})
    lag = lg.get("dispatch_lag_ms") or {}
    parts = ["", "## Load generator", ""]
    if lag:
        parts.append(f"Dispatch lag (send time - due time), ms: p50 {lag['p50']:.2f}, p99 {lag['p99']:.2f}, "
                     f"max {lag['max']:.2f}; {lg.get('late_over_10ms', 0)} of {lg['requests']} sends over 10 ms late.")
    rate = lg.get("achieved_send_rate")
    parts.append(f"Offered rate {lg.get('offered_rate') or 'inf'} req/s; achieved send rate "
                 f"{rate and round(rate, 1)} req/s.")
    if lg.get("server_counts"):  # the coordinator's counters over the measured requests
        parts += ["", "The server's own counts over the trace: "
                  + ", ".join(f"{k} {v}" for k, v in lg["server_counts"].items() if v) + "."]
    if stages:
        from mserve.bench.metrics import STAGES

        parts += ["", "## Cluster stage timings (ms, mean / p99)", ""]
        parts.append("| modality | " + " | ".join(s[:-2] for s in STAGES) + " |")
        parts.append("|---|" + "---|" * len(STAGES))
        for name, st in stages.items():
            parts.append(f"| {name} | " + " | ".join(f"{st[s]['mean']:.0f} / {st[s]['p99']:.0f}" for s in STAGES) + " |")
    return "\n".join(parts) + "\n"


def finish_run(out_dir: str | Path, trace: Sequence[Any], records: Sequence[Any], lg: dict[str, Any],
               meta: dict[str, Any], slos: dict[str, float], plots: bool = True) -> tuple[dict[str, Any], dict]:
    """Summarize and write results.json, report.md (+ load generator and stage sections) and plots."""
    from mserve.bench.metrics import run_duration, stage_breakdown, summarize
    from mserve.bench.report import write_report

    summary = summarize(records, run_duration(records), slos or None)
    stages = stage_breakdown(records)
    if stages:
        summary["stage_timings_ms"] = stages
    meta = {**meta, "loadgen": lg}
    paths = write_report(out_dir, records, summary, meta, trace=trace, plots=plots)
    with open(paths["report"], "a", encoding="utf-8") as f:
        f.write(_extra_markdown(meta, stages))
    return summary, paths


def json_rate(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"  # strict JSON has no Infinity


def default_out(kind: str, trace_name: str) -> Path:
    return Path("out") / "bench" / f"{kind}-{trace_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(args: argparse.Namespace) -> int:
    from mserve.bench.traces import save_trace

    trace = build_trace(args)
    trace_name = Path(args.trace_file).stem if args.trace_file else args.trace
    out = Path(args.out) if args.out else default_out("serve", trace_name)
    save_trace(trace, out / "trace.jsonl")
    target = make_target(args.target, args.model, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout,
                         send_classes=args.send_classes)
    max_tokens = max((r.max_tokens for r in trace), default=8)
    records, lg = asyncio.run(run_trace(target, trace, max_concurrency=args.max_concurrency, warmup=args.warmup,
                                        max_tokens=max_tokens, progress_label=None if args.no_progress else "serve"))
    meta = {"target": args.target, "model": args.model, "trace": trace_name, "num_requests": len(trace),
            "rate": None if args.trace_file else json_rate(args.rate), "burstiness": args.burstiness,
            "seed": args.seed, "interactive_share": None if args.trace_file else args.interactive_share,
            "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
            "send_classes": args.send_classes}
    summary, paths = finish_run(out, trace, records, lg, meta, args.slo, plots=not args.no_plots)
    from mserve.bench.report import render_markdown

    print(render_markdown(summary, {}).split("## By", 1)[0].rstrip())
    print(_extra_markdown({"loadgen": lg}, {}).strip())
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0 if summary["overall"]["failed"] == 0 else 1
