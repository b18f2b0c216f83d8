"""`mserve autoscale`: its flags, and the wiring of policy, signals, backend and loop.

Only the stdlib is imported at module level: `mserve --help` builds this parser.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from typing import Any

from mserve.autoscale import POOLS

log = logging.getLogger("mserve.autoscale")

DESCRIPTION = """\
Grow and shrink the encode, prefill and decode pools of a running cluster.

Every --interval seconds it reads the coordinator's STATUS (worker loads, requests in flight and
parked, latency histograms) or, when the coordinator does not answer, the loads the workers publish
to Redis, and decides per pool (first rule that applies):
  bounds     outside --min/--max: back inside at once;
  from-zero  a pool at 0 with requests parked for it (an image and no encoder): start one at once;
  starting   replicas asked for are not serving yet: wait for them;
  up         load per replica above --scale-up-at (decode: also KV use above --kv-up-at), a stage's
             p90 above --stage-slo, or the SLO (--slo-ttft/--slo-tpot) met by fewer than --slo-target
             of the requests finished since the last tick, this pool being the bottleneck: grow to
             load / scale-up-at (at least +1, at most +--max-step), outside the --up-cooldown;
  down       with one replica fewer the load per replica would be below --scale-down-at, for
             --down-stable seconds, outside the --down-cooldown: shrink by one (never below 1);
  to-zero    --encode-idle S: no image for S seconds and the encode pool empty: 0 encoders.
Load is what waits or runs in a pool: encode/prefill stages, decode sequences.

Scale-down drains: the worker gets SIGTERM, takes no new work, finishes what it has and exits
when the coordinator releases it; no request is lost or re-run. Every decision is logged with
its reason. See docs/autoscaling.md.

Per-pool options take VALUE (every pool) or POOL=VALUE, and repeat: --min encode=0 --max 4."""

EPILOG = """\
backends:
  local    start `mserve worker` processes on this host (--model, --worker-address: the
           coordinator's --worker-bind); stops only workers it started, newest first, and drains
           them all when it exits (unless --keep-workers).
  compose  docker compose up -d --no-recreate --no-deps --scale POOL=N POOL (run only where docker
           and an engine answer; otherwise logged).
  k8s      kubectl scale deployment/mserve-POOL --replicas=N (or --k8s-apply patch: a JSON patch of
           /spec/replicas); run only where kubectl has a context.

example:
  mserve autoscale --backend local --model models/tiny-llava --redis redis://127.0.0.1:6379/0 \\
      --coordinator tcp://127.0.0.1:5555 --worker-address tcp://127.0.0.1:5556 \\
      --min encode=0 --encode-idle 300 --max 4 --slo-ttft 2 --slo-tpot 0.1"""


def _per_pool(values: list[str] | None, cast: Any, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values or []:
        pool, sep, raw = item.partition("=")
        pools = [pool] if sep else list(POOLS)
        raw = raw if sep else item
        for p in pools:
            if p not in POOLS:
                raise SystemExit(f"error: {flag} {item}: unknown pool {p!r} (one of {', '.join(POOLS)})")
        try:
            value = cast(raw)
        except ValueError:
            raise SystemExit(f"error: {flag} {item}: {raw!r} is not a {cast.__name__}")
        out.update(dict.fromkeys(pools, value))
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("autoscale", help="grow and shrink the worker pools from load and SLO attainment",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--coordinator", default="tcp://127.0.0.1:5555", metavar="ADDR",
                   help="the coordinator's client address (its --bind; default %(default)s); a client API key "
                        "comes from $MSERVE_CLIENT_API_KEY")
    g.add_argument("--redis", default=None, metavar="URL",
                   help="the cluster's Redis: loads when the coordinator does not answer, and the workers the "
                        "local backend starts (default: $MSERVE_REDIS, else $REDIS_URL)")
    g.add_argument("--backend", choices=["local", "compose", "k8s"], default="local", help="default %(default)s")
    g.add_argument("--interval", type=float, default=5.0, metavar="S", help="seconds between decisions (default 5)")
    g.add_argument("--dry-run", action="store_true", help="decide and log, change nothing (commands are printed)")
    g.add_argument("--once", action="store_true", help="one decision round, then exit")

    g = p.add_argument_group("policy (per pool: VALUE or POOL=VALUE, repeatable)")
    g.add_argument("--min", action="append", metavar="[POOL=]N", help="fewest replicas (default 1)")
    g.add_argument("--max", action="append", metavar="[POOL=]N", help="most replicas (default 8)")
    g.add_argument("--scale-up-at", action="append", metavar="[POOL=]X",
                   help="grow above this load per replica (default encode/prefill 4 stages, decode 48 sequences)")
    g.add_argument("--scale-down-at", action="append", metavar="[POOL=]X",
                   help="shrink when load per replica with one fewer is below this (default 1, decode 16)")
    g.add_argument("--stage-slo", action="append", metavar="[POOL=]S",
                   help="grow when the p90 of the pool's stage time (decode: TPOT) is above S (default off)")
    g.add_argument("--up-cooldown", action="append", metavar="[POOL=]S", help="after a change, no growth for S (30)")
    g.add_argument("--down-cooldown", action="append", metavar="[POOL=]S",
                   help="after a change, no shrink for S (120)")
    g.add_argument("--down-stable", action="append", metavar="[POOL=]S",
                   help="the shrink test must hold this long first (60)")
    g.add_argument("--max-step", action="append", metavar="[POOL=]N", help="replicas added at once, at most (2)")
    g.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                   help="wait at most S for asked-for replicas to serve before deciding again (default 300)")
    g.add_argument("--kv-up-at", type=float, default=0.85, metavar="F", help="decode: grow above this KV use (0.85)")
    g.add_argument("--kv-down-at", type=float, default=0.5, metavar="F", help="decode: shrink below this KV use (0.5)")
    g.add_argument("--encode-idle", type=float, default=None, metavar="S",
                   help="scale the encode pool to zero after S seconds without an image (sets --min encode=0 "
                        "unless given); an image request then waits, parked, while one starts (up to the "
                        "coordinator's --stage-timeout-s)")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="TTFT SLO (default: not judged)")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="TPOT SLO (default: not judged)")
    g.add_argument("--slo-target", type=float, default=0.9, metavar="F",
                   help="share of requests that must meet each SLO (default 0.9)")
    g.add_argument("--slo-min-requests", type=int, default=5, metavar="N",
                   help="judge the SLO only over at least N finished requests per tick (default 5)")

    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="scale only this served model's pools, in a cluster serving several (its workers' "
                        "--model-name, default their --model path; one autoscaler per model); the local backend "
                        "passes it to the workers it starts. Default: the whole cluster, one model")
    g = p.add_argument_group("local backend")
    g.add_argument("--model", help="checkpoint folder the workers load (as the coordinator's --model)")
    g.add_argument("--worker-address", default="tcp://127.0.0.1:5556", metavar="ADDR",
                   help="the coordinator's worker address (its --worker-bind; default %(default)s)")
    g.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    g.add_argument("--transfer", choices=["auto", "shm", "tcp", "torch"], default="auto")
    g.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker started (repeat: --worker-arg=--num-blocks "
                        "--worker-arg=512)")
    g.add_argument("--log-dir", default=None, help="the workers' logs (default: a new temp dir, printed)")
    g.add_argument("--keep-workers", action="store_true", help="on exit, leave the started workers running")

    g = p.add_argument_group("compose backend")
    g.add_argument("--compose-command", default="docker compose", metavar="CMD",
                   help="the compose command (default %(default)r; 'docker-compose' for compose v1)")
    g.add_argument("--compose-file", default=None, metavar="FILE", help="docker compose -f FILE")
    g.add_argument("--compose-project", default=None, metavar="NAME", help="docker compose -p NAME")
    g.add_argument("--compose-service", action="append", metavar="POOL=NAME",
                   help="the service of a pool (default: the pool's name)")

    g = p.add_argument_group("k8s backend")
    g.add_argument("--namespace", default=None, help="kubectl -n NAMESPACE")
    g.add_argument("--context", default=None, help="kubectl --context CONTEXT")
    g.add_argument("--deployment", action="append", metavar="POOL=NAME",
                   help="the Deployment of a pool (default mserve-POOL)")
    g.add_argument("--k8s-apply", choices=["scale", "patch"], default="scale",
                   help="kubectl scale (default) or kubectl patch --type=json on /spec/replicas")


def build_config(args: argparse.Namespace) -> Any:
    from mserve.autoscale.policy import SLO, PolicyConfig, PoolPolicy, default_config

    base = default_config().pools
    mins = _per_pool(args.min, int, "--min")
    if args.encode_idle is not None:
        mins.setdefault("encode", 0)
    knobs = {"min_replicas": mins, "max_replicas": _per_pool(args.max, int, "--max"),
             "scale_up_at": _per_pool(args.scale_up_at, float, "--scale-up-at"),
             "scale_down_at": _per_pool(args.scale_down_at, float, "--scale-down-at"),
             "stage_slo_s": _per_pool(args.stage_slo, float, "--stage-slo"),
             "up_cooldown_s": _per_pool(args.up_cooldown, float, "--up-cooldown"),
             "down_cooldown_s": _per_pool(args.down_cooldown, float, "--down-cooldown"),
             "down_stable_s": _per_pool(args.down_stable, float, "--down-stable"),
             "max_step_up": _per_pool(args.max_step, int, "--max-step")}
    pools = {}
    for pool in POOLS:
        fields = {k: v[pool] for k, v in knobs.items() if pool in v}
        fields["start_timeout_s"] = args.start_timeout
        if pool == "decode":
            fields.update(kv_up_at=args.kv_up_at, kv_down_at=args.kv_down_at)
        if pool == "encode" and args.encode_idle is not None:
            fields["idle_to_zero_s"] = args.encode_idle
        b = base[pool]
        merged = {f: getattr(b, f) for f in PoolPolicy.__dataclass_fields__} | fields
        if merged["max_replicas"] < merged["min_replicas"] and "max_replicas" not in fields:
            merged["max_replicas"] = merged["min_replicas"]
        try:
            pools[pool] = PoolPolicy(**merged)
        except ValueError as exc:
            raise SystemExit(f"error: {pool} pool: {exc}")
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, target=args.slo_target, min_requests=args.slo_min_requests)
    return PolicyConfig(pools=pools, slo=slo)


def build_backend(args: argparse.Namespace, redis_url: str | None) -> Any:
    from mserve.autoscale import backends

    if args.backend == "local":
        if not args.model:
            raise SystemExit("error: --backend local needs --model (the checkpoint the workers load)")
        named = ["--model-name", args.model_name] if args.model_name else []
        return backends.LocalBackend(args.model, args.worker_address, redis_url, threads=args.threads,
                                     transfer=args.transfer, extra_args=[*named, *args.worker_arg], log_dir=args.log_dir,
                                     dry_run=args.dry_run)
    if args.backend == "compose":
        return backends.ComposeBackend(args.compose_file, args.compose_project,
                                       _per_pool(args.compose_service, str, "--compose-service"), dry_run=args.dry_run,
                                       compose_command=shlex.split(args.compose_command))
    return backends.KubernetesBackend(args.namespace, _per_pool(args.deployment, str, "--deployment"),
                                      context=args.context, mode=args.k8s_apply, dry_run=args.dry_run)


def main(args: argparse.Namespace) -> int:
    from mserve.autoscale.runner import Autoscaler
    from mserve.autoscale.signals import Reader

    redis_url = args.redis or os.environ.get("MSERVE_REDIS") or os.environ.get("REDIS_URL") or None
    config = build_config(args)
    backend = build_backend(args, redis_url)
    if args.backend == "local":
        log.info("local backend: workers' logs in %s", backend.log_dir)
    reader = Reader(args.coordinator, redis_url, model=args.model_name)
    scaler = Autoscaler(config, backend, reader, interval_s=args.interval)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        scaler.run(stop, once=args.once)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if args.backend == "local" and not args.keep_workers and not args.once:
            log.info("stopping: draining the %d worker(s) this autoscaler started", len(backend.procs))
        backend.close(stop_workers=not args.keep_workers and not args.once)
        reader.close()
    sys.stdout.flush()
    return 0
