"""`mserve bench compare`: launch each serving configuration in turn, replay one trace on each, print one table.

Configurations (comma-separated, the first is the baseline of the ratios):

* ``disagg:XeYpZd``  a LocalCluster with X encode, Y prefill and Z decode workers (``disagg`` = 1e1p1d)
* ``unified:N``      a LocalCluster with N unified workers and no stage pools (``unified`` = 1)
* ``hf-sequential``  bench/hf_server.py: transformers ``generate``, one request at a time
* ``openai:URL``     an already running OpenAI-compatible server (e.g. vLLM), not launched here
* ``zmq://HOST:PORT`` an already running MServe coordinator, not launched here

An ``openai:`` configuration may end in ``@model=NAME``: the model its requests name (else --openai-model),
so one server's model group and one of its variants compare side by side in one run, e.g.
``openai:http://gw:8000/v1@model=llava,openai:http://gw:8000/v1@model=llava-large``. When the servers say
which model answered, the table counts the requests each served model answered, overall and per class.

Every launched configuration gets --threads torch threads per worker/server (default 1), is stopped
before the next one starts, and sees the identical trace (saved as trace.jsonl in --out).

--rounds N repeats the pass N times, each round over a new trace and in a rotated order (bench/rounds.py):
the table then gives medians over the rounds, and each round's ratio to the baseline beside it. Each round
writes its trace, its reports and its own table under --out/round-R/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mserve.bench.serve import add_load_arguments

log = logging.getLogger("mserve.bench.compare")

_DISAGG = re.compile(r"^(\d+)e(\d+)p(\d+)d$")

# (label, path into the augmented overall summary built by `headline_summary`).
COMPARE_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("req/s", ("request_throughput",)),
    ("output tok/s", ("output_throughput",)),
    ("goodput req/s", ("goodput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
    ("TPOT p99 ms", ("tpot_ms", "p99")),
    ("E2E p50 ms", ("e2e_ms", "p50")),
    ("E2E p99 ms", ("e2e_ms", "p99")),
    ("text-only TTFT p50 ms", ("text", "ttft_ms", "p50")),
    ("text-only TTFT p99 ms", ("text", "ttft_ms", "p99")),
    ("image TTFT p50 ms", ("image", "ttft_ms", "p50")),
    ("image TTFT p99 ms", ("image", "ttft_ms", "p99")),
    ("text-only goodput req/s", ("text", "goodput")),
    ("image goodput req/s", ("image", "goodput")),
    ("interactive TTFT p50 ms", ("interactive", "ttft_ms", "p50")),
    ("interactive TTFT p99 ms", ("interactive", "ttft_ms", "p99")),
    ("batch TTFT p50 ms", ("batch", "ttft_ms", "p50")),
    ("batch TTFT p99 ms", ("batch", "ttft_ms", "p99")),
    ("interactive goodput req/s", ("interactive", "goodput")),
    ("batch goodput req/s", ("batch", "goodput")),
    ("generator lag p99 ms", ("loadgen", "dispatch_lag_ms", "p99")),
    # multiturn traces only (a dash elsewhere): what the caches save from turn 2 on
    ("turn 1 TTFT p50 ms", ("first_turn", "ttft_ms", "p50")),
    ("turn >=2 TTFT p50 ms", ("later_turns", "ttft_ms", "p50")),
    ("turn >=2 TTFT p99 ms", ("later_turns", "ttft_ms", "p99")),
    ("image encodes / conversation", ("encodes_per_conversation",)),
    ("prefix cache hit rate", ("cache_hit_rate", "prefix")),
    ("embedding cache hit rate", ("cache_hit_rate", "encoder")),
    ("images skipped by prefix rate", ("cache_hit_rate", "prefix_skip")),
    # an MServe coordinator's own counts over the trace (Target.counters; a dash elsewhere)
    ("stage re-runs", ("loadgen", "server_counts", "reruns")),
    ("prompts lent to decode", ("loadgen", "server_counts", "local_prefills")),
    ("requests shed", ("loadgen", "server_counts", "shed")),
)


@dataclass(frozen=True)
class ConfigSpec:
    label: str
    kind: str  # "cluster" | "hf" | "http" | "zmq"
    pools: dict[str, int] = field(default_factory=dict)
    url: str | None = None
    worker_args: tuple[str, ...] = ()  # from "@flag=value" suffixes: worker settings of this configuration...
    coordinator_args: tuple[str, ...] = ()  # ...and coordinator settings (flags that name one)
    request_model: str | None = None  # openai: the model its requests name (from "@model=NAME")
    cpu_placement: str | None = None  # the launcher's (from "@cpu-placement=auto|off"); None: --cpu-placement


def parse_config(text: str) -> ConfigSpec:
    """One configuration string -> ConfigSpec; ValueError with the accepted forms otherwise.

    A cluster configuration may end in settings, `@flag=value` each, e.g.
    `unified:2@max-prefill-tokens=256` or `disagg:1e1p1d@max-stages-per-worker=2`, so settings compare
    side by side in one run. A flag that names a coordinator setting goes to the coordinator, one that
    names a worker setting to every worker (both, where both have it: `@class-aging-s=2`); any other
    to every worker, except `@cpu-placement=auto|off`, the launcher's (`mserve up --cpu-placement`).
    An `openai:` configuration takes one setting, `@model=NAME`: the model its requests
    name (a group of variants, or one variant)."""
    from mserve.coordinator.settings import CoordinatorSettings
    from mserve.workers.settings import WorkerSettings

    text = text.strip()
    base, *overrides = text.split("@")
    args: dict[str, list[str]] = {"worker": [], "coordinator": []}
    placement = None
    for item in overrides:
        flag, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[a-z][a-z0-9-]*", flag) or not value:
            raise ValueError(f"{text!r}: settings are written @flag=value, e.g. @max-prefill-tokens=256")
        if flag == "cpu-placement":  # the launcher's setting, not a process's
            if value not in ("auto", "off"):
                raise ValueError(f"{text!r}: @cpu-placement is auto or off")
            placement = value
            continue
        field_name = flag.replace("-", "_")
        sides = [side for side, fields in (("coordinator", CoordinatorSettings.model_fields),
                                           ("worker", WorkerSettings.model_fields)) if field_name in fields]
        for side in sides or ["worker"]:  # a flag both take (--class-aging-s) goes to both
            args[side] += [f"--{flag}", value]
    spec = _parse_base(base, text)
    if spec.kind == "http" and args["coordinator"] + args["worker"]:
        if args["coordinator"][:1] != ["--model"] or len(overrides) != 1:
            raise ValueError(f"{text!r}: an openai: configuration takes one setting, @model=NAME")
        return dataclasses.replace(spec, request_model=args["coordinator"][1])
    if placement is not None and spec.kind != "cluster":
        raise ValueError(f"{text!r}: @cpu-placement applies to disagg: and unified: configurations only")
    if overrides and spec.kind != "cluster":
        raise ValueError(f"{text!r}: @settings apply to disagg: and unified: configurations only "
                         "(and @model=NAME to openai:)")
    return dataclasses.replace(spec, worker_args=tuple(args["worker"]), coordinator_args=tuple(args["coordinator"]),
                               cpu_placement=placement)


def _parse_base(base: str, text: str) -> ConfigSpec:
    kind, _, arg = base.partition(":")
    if kind == "disagg":
        m = _DISAGG.match(arg or "1e1p1d")
        if not m or not all(int(x) > 0 for x in m.groups()):
            raise ValueError(f"{text!r}: expected disagg:XeYpZd with X, Y, Z >= 1 (e.g. disagg:1e1p1d)")
        e, p, d = (int(x) for x in m.groups())
        return ConfigSpec(text, "cluster", {"encode": e, "prefill": p, "decode": d, "unified": 0})
    if kind == "unified":
        if arg and not (arg.isdigit() and int(arg) > 0):
            raise ValueError(f"{text!r}: expected unified:N with N >= 1")
        return ConfigSpec(text, "cluster", {"encode": 0, "prefill": 0, "decode": 0, "unified": int(arg or 1)})
    if base in ("hf-sequential", "hf"):
        return ConfigSpec(text, "hf")
    if kind == "openai":
        if not arg.startswith(("http://", "https://")):
            raise ValueError(f"{text!r}: expected openai:http://HOST:PORT/v1")
        return ConfigSpec(text, "http", url=arg)
    if kind in ("zmq", "tcp") and arg.startswith("//"):
        return ConfigSpec(text, "zmq", url=text)
    raise ValueError(f"unknown configuration {text!r}; expected disagg:XeYpZd, unified:N, hf-sequential, "
                     "openai:http://HOST:PORT/v1 or zmq://HOST:PORT")


def parse_configs(text: str) -> list[ConfigSpec]:
    specs = [parse_config(item) for item in text.split(",") if item.strip()]
    if not specs:
        raise ValueError("no configuration given")
    labels = [s.label for s in specs]
    dupes = {x for x in labels if labels.count(x) > 1}
    if dupes:
        raise ValueError(f"configuration(s) given twice: {', '.join(sorted(dupes))}")
    return specs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder every configuration serves")
    p.add_argument("--configs", default="disagg:1e1p1d,unified:1,hf-sequential",
                   help="comma-separated configurations; ratios are against the first "
                        "(default disagg:1e1p1d,unified:1,hf-sequential)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker / server (default 1)")
    p.add_argument("--transfer", default="auto", help="cluster tensor transport (default auto)")
    p.add_argument("--cpu-placement", choices=["auto", "off"], default="auto",
                   help="launched clusters' CPU placement, as `mserve up --cpu-placement` (default auto); one "
                        "configuration can differ with @cpu-placement=off")
    p.add_argument("--openai-model", default=None,
                   help="model name for openai: configurations (default: the first of its /v1/models)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for a configuration")
    p.add_argument("--dead-after-s", type=float, default=None,
                   help="launched coordinators' heartbeat timeout (default: the coordinator's own, 5 s)")
    add_load_arguments(p)
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="repeat the pass over the configurations N times (default 1), each round over a new trace "
                        "(--seed plus the round) and starting at the next configuration; the table gives "
                        "medians over the rounds and each round's ratio to the first configuration. For a host "
                        "whose speed drifts, where one pass's ratios say more about the minute than the servers")
    p.add_argument("--out", default=None, help="output folder (default out/bench/compare-TRACE-TIME)")


# --------------------------------------------------------------------------- the table


def headline_summary(summary: dict[str, Any], records: list[Any], slos: dict[str, float],
                     loadgen: dict[str, Any]) -> dict[str, Any]:
    """The overall summary plus "text" (text-only) and "image" (any image) groups and the generator stats."""
    from mserve.bench.metrics import run_duration, summarize_group

    duration = run_duration(records)
    out = dict(summary.get("overall", {}))
    out["text"] = summarize_group([r for r in records if r.modality == "text"], duration, slos or None)
    out["image"] = summarize_group([r for r in records if r.modality != "text"], duration, slos or None)
    for cls in ("interactive", "batch"):
        out[cls] = summarize_group([r for r in records if r.latency_class == cls], duration, slos or None)
    out["loadgen"] = loadgen
    if any(getattr(r, "turn", 0) for r in records):
        out.update(multiturn_groups(records, duration, slos))
    return out


def multiturn_groups(records: list[Any], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    """First turns vs later turns, and how many images were encoded per conversation (neither read from
    an embedding cache nor skipped for a cached prefix: 1 per image is the ideal, one per image per turn
    is no cache at all)."""
    from mserve.bench.metrics import summarize_group

    encodes: dict[str, float] = {}
    for r in records:
        hits, images = r.cache_hits.get("encoder", (0, 0)) if r.ok else (0, 0)
        skipped = r.cache_hits.get("prefix_skip", (0, 0))[0] if r.ok else 0
        encodes[r.conversation_id] = encodes.get(r.conversation_id, 0) + images - hits - skipped
    return {"first_turn": summarize_group([r for r in records if r.turn == 0], duration, slos or None),
            "later_turns": summarize_group([r for r in records if r.turn > 0], duration, slos or None),
            "encodes_per_conversation": sum(encodes.values()) / len(encodes) if encodes else None}


def served_model_rows(rows: list[tuple[str, dict[str, Any]]]) -> tuple[list[tuple[str, dict[str, Any]]],
                                                                        list[tuple[str, tuple[str, ...]]]]:
    """(the rows with every model any row saw in each one's `served_models`, 0 where it answered none;
    the table metrics that count them: overall, interactive, batch). Nothing added when no configuration
    was answered by more than one model: then the rows would only say which name each target gives its
    one model (vLLM's served name beside MServe's path); a configuration that failed (an empty summary)
    stays empty."""
    if not any(len(summ.get("served_models") or {}) > 1 for _, summ in rows):
        return rows, []
    models = sorted({m for _, summ in rows for m in (summ.get("served_models") or {})})
    groups = (("", None), ("interactive ", "interactive"), ("batch ", "batch"))
    filled = []
    for label, summ in rows:
        if summ:
            summ = dict(summ)
            for _, key in groups:
                group = summ if key is None else dict(summ.get(key) or {})
                group["served_models"] = {m: (group.get("served_models") or {}).get(m, 0) for m in models}
                if key is not None:
                    summ[key] = group
        filled.append((label, summ))
    metrics = [(f"{prefix}answered by {m}", (*((key,) if key else ()), "served_models", m))
               for prefix, key in groups for m in models]
    return filled, metrics


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "config"


def run_pass(specs: list[ConfigSpec], order: list[int], trace: list[Any], seed: int, args: argparse.Namespace,
             out: Path, round_note: str = "") -> tuple[dict[str, dict], dict[str, str], list[str]]:
    """Each configuration in `order` in turn on the same trace (made with `seed`): ({label: headline
    summary, empty where it failed}, {label: why it failed}, host load lines). Reports go to out/IDX-LABEL/."""
    from mserve.bench.launch import launched
    from mserve.bench.serve import finish_run, json_rate, run_trace
    from mserve.bench.targets import make_target

    trace_name = Path(args.trace_file).stem if args.trace_file else args.trace
    max_tokens = max((r.max_tokens for r in trace), default=8)
    rows: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    hosts: list[str] = []
    for n, idx in enumerate(order):
        spec = specs[idx]
        sub = out / f"{idx}-{slug(spec.label)}"
        print(f"== {round_note}[{n + 1}/{len(order)}] {spec.label}", file=sys.stderr, flush=True)
        t0, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            with launched(spec, args, sub / "logs") as (url, http_model):
                target = make_target(url, http_model, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout,
                                     send_classes=args.send_classes)
                records, lg = asyncio.run(run_trace(
                    target, trace, max_concurrency=args.max_concurrency, warmup=args.warmup, max_tokens=max_tokens,
                    progress_label=None if args.no_progress else spec.label))
        except Exception as exc:  # one configuration failing must not lose the others' results
            log.error("%s failed: %s", spec.label, exc)
            failures[spec.label] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            rows[spec.label] = {}
            continue
        meta = {"target": url, "config": spec.label, "model": str(args.model), "trace": trace_name,
                "num_requests": len(trace), "rate": None if args.trace_file else json_rate(args.rate),
                "burstiness": args.burstiness, "seed": seed,
                "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "threads": args.threads,
                "dead_after_s": args.dead_after_s, "http_model": http_model, "send_classes": args.send_classes,
                "interactive_share": None if args.trace_file else args.interactive_share,
                # Other tenants of a small host show up here: compare against the configuration's own load.
                "host_loadavg_1m": {"start": load_before, "end": os.getloadavg()[0]}}
        summary, _ = finish_run(sub, trace, records, lg, meta, args.slo, plots=not args.no_plots)
        rows[spec.label] = headline_summary(summary, records, args.slo, lg)
        hosts.append(f"- {round_note}{spec.label}: host load average (1 min) {load_before:.2f} before, "
                     f"{meta['host_loadavg_1m']['end']:.2f} after")
        print(f"   {spec.label}: {summary['overall']['completed']}/{len(trace)} ok in "
              f"{time.perf_counter() - t0:.0f}s (incl. start/stop) -> {sub}", file=sys.stderr, flush=True)
    return rows, failures, hosts


def main(args: argparse.Namespace) -> int:
    import shlex

    from mserve.bench.report import compare_table
    from mserve.bench.rounds import median_summary, round_order, round_ratio_table, round_seed
    from mserve.bench.serve import build_trace, default_out
    from mserve.bench.traces import save_trace

    def _terminate(*_: Any) -> None:
        raise SystemExit(143)  # unwinds through `launched`, which stops what it started

    signal.signal(signal.SIGTERM, _terminate)
    try:
        specs = parse_configs(args.configs)
    except ValueError as exc:
        raise SystemExit(f"error: --configs: {exc}") from None
    if args.rounds < 1:
        raise SystemExit("error: --rounds: at least 1")
    trace_name = Path(args.trace_file).stem if args.trace_file else args.trace
    out = Path(args.out) if args.out else default_out("compare", trace_name)
    if args.rounds > 1 and args.trace_file:
        log.warning("--trace-file: every round replays the same file, so a server kept up between rounds "
                    "(openai:, zmq://) may find the last round's images and prefixes in its caches")

    rounds: list[dict[str, dict[str, Any]]] = []
    failures: dict[str, str] = {}
    hosts: list[str] = []
    labels = [s.label for s in specs]
    for r in range(args.rounds):
        folder = out if args.rounds == 1 else out / f"round-{r}"  # one round: today's layout
        seed = round_seed(args.seed, r)
        trace = build_trace(argparse.Namespace(**{**vars(args), "seed": seed}))
        save_trace(trace, folder / "trace.jsonl")
        note = "" if args.rounds == 1 else f"round {r + 1}/{args.rounds} "
        rows, failed, host = run_pass(specs, round_order(len(specs), r), trace, seed, args, folder, note)
        rounds.append(rows)
        hosts += host
        for label, why in failed.items():
            failures.setdefault(label, why if args.rounds == 1 else f"round {r + 1}: {why}")
        if args.rounds > 1:
            (folder / "compare.md").write_text(compare_table([(k, rows.get(k, {})) for k in labels],
                                                             COMPARE_METRICS) + "\n", encoding="utf-8")

    medians = [(label, median_summary([rows.get(label, {}) for rows in rounds])) for label in labels]
    medians, served = served_model_rows(medians)
    table = compare_table(medians, (*COMPARE_METRICS, *served))
    seeds = (f"seed {args.seed}" if args.rounds == 1 else
             f"{args.rounds} rounds, seeds {args.seed}-{round_seed(args.seed, args.rounds - 1)}, order rotated")
    load = (f"trace `{trace_name}`, {len(trace)} requests, rate {args.rate} req/s (burstiness {args.burstiness}), "
            f"max_tokens {args.max_tokens}{' (ignore_eos)' if args.ignore_eos else ''}, {seeds}, "
            + ("" if args.trace_file else f"interactive share {args.interactive_share:g}, ")
            + ("priority and class sent over HTTP, " if args.send_classes else "")
            + f"{args.threads} torch thread(s) per worker/server"
            + (f", coordinator --dead-after-s {args.dead_after_s:g}" if args.dead_after_s is not None else "")
            + (f", SLOs {args.slo} ms" if args.slo else ""))
    per_round = round_ratio_table(rounds, labels) if args.rounds > 1 else ""
    md = "\n".join([
        "# MServe serving comparison", "", f"- command: `{shlex.join(sys.argv)}`", f"- load: {load}",
        *(f"- **{k} failed**: {v}" for k, v in failures.items()), "",
        *([f"## Median over {args.rounds} rounds", ""] if per_round else []), table, "",
        *([f"## Each round's ratio to {labels[0]}, taken inside the round", "", per_round, ""] if per_round else []),
        *hosts, ""])
    (out / "compare.md").write_text(md, encoding="utf-8")
    (out / "compare.json").write_text(json.dumps({"configs": labels, "load": load, "summaries": dict(medians),
                                                  "rounds": rounds, "failures": failures},
                                                 indent=1, default=str) + "\n", encoding="utf-8")
    print(table)
    if per_round:
        print(f"\nEach round's ratio to {labels[0]}:\n{per_round}")
    print(f"\nwrote {out / 'compare.md'} and per-configuration reports under {out}", file=sys.stderr)
    return 1 if failures else 0
