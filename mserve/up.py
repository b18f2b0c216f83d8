"""`mserve up`: a whole local cluster (Redis, coordinator, worker pools, optionally the HTTP gateway) in
one command, kept up until Ctrl-C or SIGTERM. The processes are started by LocalCluster
(coordinator/launcher.py); this module is only the command around it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from mserve.coordinator.launcher import ClusterStartError, LocalCluster

logger = logging.getLogger("mserve.coordinator.launcher")


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None,
                        help="local checkpoint folder of a served family (README, \"Model families\"); repeat it to "
                             "serve several models from one cluster, each with the role counts below (the first is "
                             "the default for requests that name no model; clients name one by its folder path)")
    parser.add_argument("--models-file", default=None, metavar="FILE",
                        help="several models with their own role counts, a JSON or YAML file: {\"models\": [{\"model\": "
                             "FOLDER, \"encode\": N, \"prefill\": N, \"decode\": N, \"unified\": N}, ...]}; a missing "
                             "count is 1 (0 for unified, and for the stage roles of an entry with only unified); "
                             "combines with --model, whose models come first")
    parser.add_argument("--encode", type=int, default=None,
                        help="encode workers (with no role flag at all: picked for the host, see --unified; naming "
                             "any stage role makes the others default to 1 and --unified to 0)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill workers (as --encode)")
    parser.add_argument("--decode", type=int, default=None, help="decode workers (as --encode)")
    parser.add_argument("--unified", type=int, default=None,
                        help="workers running all three stages. With no role flag at all, mserve up picks the roles "
                             "for the host and prints them: one unified worker per CPU core, at most 8, the cores "
                             "shared out as threads (the fastest layout measured on small hosts, bench/README.md); "
                             "name --encode/--prefill/--decode for separate pools")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="existing redis (default: $REDIS_URL, else a private redis-server)")
    parser.add_argument("--port", type=int, default=None, help="client port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--coordinators", type=int, default=1,
                        help="coordinator shards (default 1); with more, each announces itself in Redis, every worker "
                             "joins every shard, and clients spread requests over them (docs/scaling.md)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default 1; with roles picked for the host, its cores "
                             "shared out)")
    parser.add_argument("--cpu-placement", choices=["auto", "off"], default="auto",
                        help="auto: each worker on CPU cores of its own, heaviest role first (unified, prefill, "
                             "decode, encode); with no more cores than workers the last core is shared by the "
                             "rest and the coordinator (and gateway); where the coordinator has a core no worker "
                             "runs on, the workers' IO threads (image decoding and processing, transfers) run there "
                             "too. off: Linux places them. Uses the cores "
                             "this command may run on (taskset, a container's cpuset). Default auto")
    from mserve.common.serving_defaults import add_dtype_arguments

    add_dtype_arguments(parser, "every worker")
    parser.add_argument("--transfer", choices=["auto", "shm", "tcp", "torch"], default="auto",
                        help="worker-to-worker tensor transport (default auto)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also start the OpenAI-compatible HTTP gateway on this port (see `mserve gateway`)")
    parser.add_argument("--api-key", default=None,
                        help="with --http-port: the key /v1 requests must carry (default: $MSERVE_API_KEY, else none)")
    parser.add_argument("--client-api-key", default=None,
                        help="require this key on the ZeroMQ client API (default: $MSERVE_CLIENT_API_KEY, else none)")
    parser.add_argument("--curve-dir", default=None, metavar="DIR",
                        help="CURVE on the worker link and the data plane, keys in DIR (made if missing)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for every worker")
    parser.add_argument("--log-dir", default=None, help="keep the child processes' logs here (default: a temp dir)")
    parser.add_argument("--role-switching", action="store_true", default=False,
                        help="let the coordinator move a prefill or decode worker to the other pool as the load mix "
                             "shifts (it drains first; the coordinator's --role-switching)")
    parser.add_argument("--coordinator-args", default=None, metavar="'FLAGS'",
                        help="more flags for the coordinator, as `mserve coordinator` takes them, in one quoted "
                             "string after '=', e.g. --coordinator-args='--local-prefill-tokens 1400 --kv-hand-back'; "
                             "checked before anything starts")
    parser.add_argument("--worker-args", default=None, metavar="'FLAGS'",
                        help="more flags for every worker, as `mserve worker` takes them, in one quoted string after "
                             "'=', e.g. --worker-args='--max-num-seqs 32'; checked before anything starts")
    from mserve.common.pruning import add_argument as add_pruning_argument
    from mserve.common.tracing import add_argument as add_tracing_argument

    add_pruning_argument(parser, "Given to the coordinator and every worker alike.")
    add_tracing_argument(parser)


def role_counts(args: argparse.Namespace) -> tuple[dict[str, int], int]:
    """The role counts of each --model and the threads per worker. With no role flag at all, the host's
    default layout (common/serving_defaults.py), logged; with --unified alone, no stage pools; naming
    any stage role, the unnamed ones are 1 and unified 0, as before."""
    named = {r: getattr(args, r) for r in ("encode", "prefill", "decode", "unified")}
    if all(n is None for n in named.values()):
        from mserve.common.cpu_placement import usable_cores
        from mserve.common.serving_defaults import default_layout

        layout = default_layout(len(usable_cores()))
        threads = args.threads or layout.threads
        logger.info("mserve up: no roles named, picked %s; name --encode/--prefill/--decode/--unified to choose",
                    layout.describe() if args.threads is None else f"{layout.describe()}, --threads {threads}")
        return {"encode": layout.encode, "prefill": layout.prefill, "decode": layout.decode,
                "unified": layout.unified}, threads
    stage_default = 0 if named["unified"] and all(named[r] is None for r in ("encode", "prefill", "decode")) else 1
    counts = {r: stage_default if named[r] is None else named[r] for r in ("encode", "prefill", "decode")}
    return {**counts, "unified": named["unified"] or 0}, args.threads or 1


def run_as(args: argparse.Namespace, model: str) -> str:
    """The dtype and attention the workers run (their --dtype / --attention, else the serving defaults)."""
    from mserve.common.serving_defaults import serving_dtype_for

    dtype = serving_dtype_for("cpu", getattr(args, "dtype", None), model)
    return f"{dtype} weights, {'exact' if getattr(args, 'attention', None) == 'exact' else 'padded'} attention"


def run_up(args: argparse.Namespace) -> int:
    """Start a cluster, print where to send requests, and keep it up until Ctrl-C or SIGTERM."""
    pools, threads = role_counts(args)
    try:
        models = [(m, pools) for m in args.model or []]
        models += read_models_file(args.models_file) if args.models_file else []
    except (OSError, ValueError) as exc:
        logger.error("mserve up failed: %s", exc)
        return 1
    if not models:
        logger.error("mserve up failed: name a model (--model FOLDER, repeatable, or --models-file FILE)")
        return 1
    if len({m for m, _ in models}) < len(models):
        logger.error("mserve up failed: a model is named twice: %s", [m for m, _ in models])
        return 1
    try:
        coordinator_flags = passed_flags(getattr(args, "coordinator_args", None), "coordinator")
        worker_flags = passed_flags(getattr(args, "worker_args", None), "worker")
    except ValueError as exc:
        logger.error("mserve up failed: %s", exc)
        return 1
    stop = threading.Event()
    if getattr(args, "otlp_endpoint", None):  # every process of the cluster reads the standard variable
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_endpoint
    pruning = getattr(args, "visual_token_pruning", None)
    pruning_args = ["--visual-token-pruning", pruning] if pruning is not None else []
    worker_args = [*pruning_args, *(["--dtype", args.dtype] if getattr(args, "dtype", None) else []),
                   *(["--attention", args.attention] if getattr(args, "attention", None) else [])]
    # Refuse a model the engine cannot serve exactly, or a family that cannot prune, before starting anything.
    from mserve.common import pruning as visual_pruning
    from mserve.common.model import load_family

    try:
        for model, _ in models:
            family = load_family(model)
            if pruning is not None:
                visual_pruning.apply(family, pruning)
    except (ValueError, FileNotFoundError) as exc:  # UnsupportedModelError, PruningError, CheckpointError
        logger.error("mserve up failed: %s", exc)
        return 1
    (first, counts), *others = models
    cluster = LocalCluster(first, **counts, other_models=others, redis_url=args.redis, port=args.port,
                           threads=threads, transfer=args.transfer, log_dir=args.log_dir,
                           client_api_key=args.client_api_key, curve_dir=args.curve_dir,
                           extra_worker_args=[*worker_args, *worker_flags],
                           extra_coordinator_args=[*pruning_args, *coordinator_flags,
                                                   *(["--role-switching"] if getattr(args, "role_switching", False) else [])],
                           coordinators=args.coordinators, cpu_placement=args.cpu_placement)
    try:
        cluster.start(timeout_s=args.start_timeout)
    except (ClusterStartError, RuntimeError, ValueError) as exc:
        logger.error("mserve up failed: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    http_url = None
    if args.http_port:
        try:
            # The key travels in the environment, not on a command line other users can read.
            if args.api_key:
                os.environ["MSERVE_API_KEY"] = args.api_key
            http_url = cluster.start_gateway(args.http_port)
        except (ClusterStartError, RuntimeError) as exc:
            logger.error("mserve up: the HTTP gateway did not start: %s", exc)
            cluster.stop()
            return 1
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"MServe cluster up: {cluster._describe()}, {run_as(args, first)}; clients connect to "
              f"{cluster.address}", flush=True)
        if len(cluster.models) > 1:
            print(f"  models (send one as 'model'): {cluster.models[0]} (the default), "
                  + ", ".join(cluster.models[1:]), flush=True)
        if http_url:
            print(f"  OpenAI API at {http_url}/v1 (health {http_url}/health, metrics {http_url}/metrics)", flush=True)
        print(f'  try: python -c "from mserve.coordinator.client import Client; '
              f"print(Client('{cluster.address}').generate([{{'role': 'user', 'content': 'Hello'}}]).text)\"",
              flush=True)
        print("  Ctrl-C stops the cluster", flush=True)
        return _watch(cluster, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        cluster.stop()


# What `mserve up` sets on each process itself, or takes as a flag of its own: not passed through.
_OWN_FLAGS = {
    "coordinator": ("--model", "--bind", "--worker-bind", "--redis", "--shard-id", "--advertise", "--worker-advertise",
                    "--cpus", "--client-api-key", "--visual-token-pruning", "--otlp-endpoint"),
    "worker": ("--role", "--model", "--coordinator", "--redis", "--worker-id", "--cpus", "--io-cpus", "--threads",
               "--transfer", "--dtype", "--attention", "--host-embedding-cache-dir", "--visual-token-pruning",
               "--otlp-endpoint"),
}


def passed_flags(text: str | None, process: str) -> list[str]:
    """--coordinator-args / --worker-args: the flags, split as a shell splits them, checked against that
    process's own command line, so a misspelt flag or a bad value stops `mserve up` before anything starts.
    ValueError naming the flag otherwise."""
    import shlex

    if not text:
        return []
    what = f"--{process}-args"
    try:
        flags = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    own = [f for f in flags if f.split("=", 1)[0] in _OWN_FLAGS[process] or f.startswith("--curve-")]
    if own:
        raise ValueError(f"{what}: {own[0].split('=', 1)[0]} is set by mserve up itself (its own flags: mserve up "
                         "--help)")
    if process == "coordinator":
        from mserve.coordinator.cli import add_arguments
    else:
        from mserve.workers.cli import add_arguments
    parser = argparse.ArgumentParser(prog=f"mserve {process}", add_help=False, allow_abbrev=False,
                                     exit_on_error=False)
    add_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if unknown:
        raise ValueError(f"{what}: `mserve {process}` has no {unknown[0]} (`mserve {process} --help` lists its flags)")
    return flags


def read_models_file(path: str) -> list[tuple[str, dict[str, int]]]:
    """[(folder, {role: count})] from a --models-file (JSON, or YAML when the name ends in .yaml/.yml)."""
    with open(path) as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            doc = yaml.safe_load(f)
        else:
            import json

            doc = json.load(f)
    entries = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected {{\"models\": [{{\"model\": FOLDER, \"decode\": N, ...}}, ...]}}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{path}: models[{i}] needs \"model\": the checkpoint folder")
        unknown = set(entry) - {"model", "encode", "prefill", "decode", "unified"}
        if unknown:
            raise ValueError(f"{path}: models[{i}] has unknown keys {sorted(unknown)} (model, encode, prefill, "
                             "decode, unified)")
        stage_default = 0 if entry.get("unified") and not any(r in entry for r in ("encode", "prefill", "decode")) else 1
        counts = {r: entry.get(r, stage_default) for r in ("encode", "prefill", "decode")}
        counts["unified"] = entry.get("unified", 0)
        if not all(isinstance(n, int) and n >= 0 for n in counts.values()):
            raise ValueError(f"{path}: models[{i}] role counts must be whole numbers >= 0, got {counts}")
        out.append((entry["model"], counts))
    return out


def _watch(cluster: LocalCluster, stop: threading.Event) -> int:
    """Wait for a stop signal; say so when a child dies (the coordinator re-routes around dead workers)."""
    reported: set[str] = set()
    while not stop.wait(1.0):
        for name, proc in cluster.processes.items():
            if proc.poll() is not None and name not in reported:
                reported.add(name)
                logger.warning("%s exited with code %s; log tail:\n%s", name, proc.returncode,
                               cluster.log_tail(name, 10))
                if name == "coordinator" or (name.startswith("coordinator-") and all(
                        cluster.processes[c].poll() is not None for c in cluster.coordinator_names())):
                    logger.error("no coordinator is left: stopping the cluster")
                    return 1
                if name.startswith("coordinator-"):
                    logger.warning("%s is gone: its clients send their requests to the other shards", name)
    logger.info("stopping the cluster")
    return 0


def _main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="mserve up", description=run_up.__doc__)
    add_up_arguments(parser)
    return run_up(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
