"""Rounds of a side-by-side (`mserve bench compare --rounds N`): what is measured in each, and what is
reported over them. Pure: no processes, no clock.

On a shared host whose speed drifts by minutes, one pass over the configurations in a fixed order can give
one configuration a quick minute and the next a slow one; a ratio from that pass says more about the host
than about the servers. N rounds repeat the pass: round r replays a new trace (the seed plus r, so a server
kept up between rounds finds none of the last round's images and prefixes in its caches) and starts at
configuration r (the order rotated, so no configuration always runs first or last). The report gives each
metric's median over the rounds, and each round's ratio to the baseline, taken inside that round: ratios
that disagree from round to round are the host's noise, and say how far any one of them can be trusted.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from mserve.bench.report import at_path

# The metrics whose per-round ratios the report lists (label, path into a headline summary).
ROUND_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("req/s", ("request_throughput",)),
    ("goodput req/s", ("goodput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
    ("text-only TTFT p99 ms", ("text", "ttft_ms", "p99")),
    ("image TTFT p99 ms", ("image", "ttft_ms", "p99")),
)


def round_order(n: int, r: int) -> list[int]:
    """Configuration indices in round r's order: 0..n-1 rotated to start at r (mod n)."""
    return [(r + i) % n for i in range(n)] if n else []


def round_seed(seed: int, r: int) -> int:
    """Round r's trace seed (round 0 keeps --seed, so one round is today's run)."""
    return seed + r


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several rounds' summaries of one configuration: each number the median over the
    rounds that have it (a None is a round without one), anything else (error texts, SLOs) as the first
    round has it. Empty summaries (a round the configuration failed) are left out; none left gives {}."""
    given = [s for s in summaries if s]
    if not given:
        return {}
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for s in given for k in s):
        values = [s[key] for s in given if key in s]
        numbers = [v for v in values if _number(v)]
        if numbers and len(numbers) == sum(v is not None for v in values):  # a round's None: it had none
            mid = statistics.median(numbers)
            out[key] = int(mid) if all(isinstance(v, int) for v in numbers) and mid == int(mid) else mid
        elif all(isinstance(v, dict) for v in values):
            out[key] = median_summary(values)
        else:
            out[key] = next((v for v in values if v is not None), values[0])
    return out


def round_ratios(rounds: Sequence[dict[str, dict[str, Any]]], labels: Sequence[str],
                 path: tuple[str, ...]) -> dict[str, list[float | None]]:
    """{label: [its value over the baseline's in each round]} for every label but the first (the
    baseline); None for a round where either has no value."""
    base = labels[0]
    out: dict[str, list[float | None]] = {}
    for label in labels[1:]:
        ratios: list[float | None] = []
        for rows in rounds:
            v, b = at_path(rows.get(label) or {}, path), at_path(rows.get(base) or {}, path)
            ratios.append(v / b if _number(v) and _number(b) and b else None)
        out[label] = ratios
    return out


def round_ratio_table(rounds: Sequence[dict[str, dict[str, Any]]], labels: Sequence[str],
                      metrics: Sequence[tuple[str, tuple[str, ...]]] = ROUND_METRICS) -> str:
    """Markdown: per metric and configuration, each round's ratio to the baseline and their median."""
    if len(labels) < 2:
        return ""
    header = ["metric"] + [f"{label} / {labels[0]}" for label in labels[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, path in metrics:
        ratios = round_ratios(rounds, labels, path)
        cells = []
        for label in labels[1:]:
            got = [x for x in ratios[label] if x is not None]
            each = ", ".join("-" if x is None else f"{x:.2f}x" for x in ratios[label])
            cells.append(f"{each} (median {statistics.median(got):.2f}x)" if got else each)
        if any(x is not None for label in labels[1:] for x in ratios[label]):
            lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)
