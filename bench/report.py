"""Writes a benchmark run to disk (results.json, report.md, PNG plots) and compares runs as markdown."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from mserve.bench.metrics import RequestRecord

log = logging.getLogger(__name__)

# (label, path into a group summary); drives every table.
HEADLINE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("req/s", ("request_throughput",)),
    ("output tok/s", ("output_throughput",)),
    ("total tok/s", ("total_token_throughput",)),
    ("goodput req/s", ("goodput",)),
    *(
        (f"{m.upper()} {s} ms", (f"{m}_ms", s))
        for m in ("ttft", "tpot", "itl", "e2e")
        for s in ("p50", "p90", "p99", "mean")
    ),
)
# Class tables keep only the columns that fit on a screen.
_CLASS_COLUMNS = (
    "completed", "failed", "req/s", "output tok/s", "goodput req/s",
    "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "E2E p50 ms", "E2E p99 ms",
)


def at_path(summary: dict[str, Any], path: Sequence[str]) -> Any:
    """The figure at `path` in a (nested) summary; None where any key on the way is missing."""
    cur: Any = summary
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _overall(summary: dict[str, Any]) -> dict[str, Any]:
    # Accept either summarize()'s {"overall": ...} or a bare group summary.
    return summary.get("overall", summary)


def compare_table(named_summaries: list[tuple[str, dict[str, Any]]],
                  metrics: Sequence[tuple[str, tuple[str, ...]]] = HEADLINE) -> str:
    """One markdown table of headline metrics for several runs, each with its ratio to the first.

    metrics: (label, path into each run's overall summary) rows; HEADLINE by default.
    """
    if not named_summaries:
        return ""
    base_name, base = named_summaries[0][0], _overall(named_summaries[0][1])
    header = ["metric", base_name] + [f"{name} (vs {base_name})" for name, _ in named_summaries[1:]]
    rows = []
    for label, path in metrics:
        base_v = at_path(base, path)
        row = [label, _fmt(base_v)]
        for _, summ in named_summaries[1:]:
            v = at_path(_overall(summ), path)
            ratio = f" ({v / base_v:.2f}x)" if v is not None and base_v not in (None, 0) else ""
            row.append(_fmt(v) + ratio)
        rows.append(row)
    return _table(header, rows)


def render_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    parts = ["# MServe benchmark report", ""]
    for key in ("target", "model", "trace", "trace_digest", "command_line", "created"):
        if key in meta:
            parts.append(f"- **{key}**: `{meta[key]}`")
    overall = _overall(summary)
    if overall.get("slos_ms"):
        parts.append(f"- **SLOs (ms)**: `{overall['slos_ms']}`")
    parts += ["", "## Overall", ""]
    parts.append(_table(["metric", "value"], [[label, _fmt(at_path(overall, path))] for label, path in HEADLINE]))
    if overall.get("errors"):
        parts += ["", "Errors: " + ", ".join(f"{k}: {v}" for k, v in overall["errors"].items())]
    if overall.get("cache_hit_rate"):
        rates = ", ".join(f"{k}: {_fmt(v)}" for k, v in overall["cache_hit_rate"].items())
        parts += ["", "Cache hit rates: " + rates]
    columns = [h for h in HEADLINE if h[0] in _CLASS_COLUMNS]
    for fld, groups in summary.get("by_class", {}).items():
        parts += ["", f"## By {fld}", ""]
        rows = [[value] + [_fmt(at_path(g, path)) for _, path in columns] for value, g in groups.items()]
        parts.append(_table([fld] + [c[0] for c in columns], rows))
    return "\n".join(parts) + "\n"


def _plot(out_dir: Path, records: list[RequestRecord]) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on benchmark hosts
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed; skipping plots")
        return {}
    done = [r for r in records if r.ok]
    paths: dict[str, Path] = {}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft_s", "e2e_s")):
        groups = {"all": done}
        for r in done:
            groups.setdefault(r.modality, []).append(r)
        for label, group in groups.items():
            vals = np.sort([getattr(r, metric) * 1000 for r in group if getattr(r, metric) is not None])
            if len(vals):
                ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=f"{label} (n={len(vals)})")
        ax.set_xlabel(f"{metric[:-2].upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    paths["latency_cdf"] = out_dir / "latency_cdf.png"
    fig.savefig(paths["latency_cdf"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    if records:
        t0 = min(r.start_s for r in records)
        tokens = np.array([t - t0 for r in done for t in r.token_times_s])
        ends = np.array([r.end_s - t0 for r in done if r.end_s is not None])
        horizon = max([1.0, *tokens.tolist(), *ends.tolist()])
        bins = np.arange(0.0, math.ceil(horizon) + 1.0)  # 1 s bins
        ax.stairs(np.histogram(tokens, bins)[0], bins, label="output tokens/s")
        ax2 = ax.twinx()
        ax2.stairs(np.histogram(ends, bins)[0], bins, color="tab:orange", label="completed req/s")
        ax2.set_ylabel("requests/s")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths["throughput"] = out_dir / "throughput.png"
    fig.savefig(paths["throughput"], dpi=100)
    plt.close(fig)
    return paths


def write_report(
    out_dir: str | Path,
    records: Sequence[RequestRecord],
    summary: dict[str, Any],
    meta: dict[str, Any] | None = None,
    *,
    trace: Sequence[Any] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write results.json, report.md and (if matplotlib is present) PNG plots; return their paths.

    meta gains `command_line` and `created` unless given; pass `trace` (or put
    `trace_digest` in meta) so the run can be tied to the exact trace it replayed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("command_line", shlex.join(sys.argv))
    meta.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    if trace is not None and "trace_digest" not in meta:
        from mserve.bench.traces import trace_digest

        meta["trace_digest"] = trace_digest(trace)
    if "trace_digest" not in meta:
        log.warning("results.json has no trace_digest; the run cannot be matched to its trace")

    paths = {"results": out / "results.json", "report": out / "report.md"}
    results = {"meta": meta, "summary": summary, "records": [asdict(r) for r in records]}
    paths["results"].write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    paths["report"].write_text(render_markdown(summary, meta), encoding="utf-8")
    if plots:
        paths.update(_plot(out, list(records)))
    return paths
