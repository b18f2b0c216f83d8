"""The `mserve` command: one entry point, one subcommand per role (names are a contract: manifests call them).

Heavy imports (torch, transformers) happen inside each handler so `mserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time



# Set before any import of transformers: nothing reaches a model hub, and transformers' progress bars and advice
# are noise in a CLI that prints JSON (coordinator/spawn.py's fork server imports it with these too).
ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from mserve.common.tiny_model import make_tiny_model

    t0 = time.perf_counter()
    out = make_tiny_model(args.out_dir, args.arch, args.size, seed=args.seed, layout=args.layout)
    print(f"wrote {args.arch} ({args.size}, seed {args.seed}, {args.layout} layout) checkpoint to {out} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


def _settings_from_args(cls, args: argparse.Namespace):
    """Flags override MSERVE_* env vars, which override defaults (pydantic-settings does the env).
    Every flag whose name is a field of `cls` is passed on: a list kept by hand here once dropped
    `mserve worker --attention` without a word."""
    given = {f: getattr(args, f) for f in cls.model_fields if getattr(args, f, None) is not None}
    settings = cls(**given)
    logging.getLogger("mserve").info("settings: %s", settings.model_dump_json())
    return settings


def cmd_coordinator(args: argparse.Namespace) -> int:
    from mserve.coordinator.server import Coordinator
    from mserve.coordinator.settings import CoordinatorSettings

    settings = _settings_from_args(CoordinatorSettings, args)
    from mserve.common.pruning import PruningError

    _start_tracing("mserve-coordinator", settings.otlp_endpoint, shard=settings.shard_id)
    try:
        coord = Coordinator(settings)
    except (PruningError, ValueError) as exc:
        raise SystemExit(f"error: {exc}")
    import signal

    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    try:
        coord.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        coord.close()
        tracing_shutdown()
    return 0


def _start_tracing(service: str, endpoint: str | None, **attributes: str | None) -> None:
    """OpenTelemetry on for this process when an endpoint is given or configured (common/tracing.py)."""
    from mserve.common import tracing

    try:
        if tracing.configure(service, endpoint, attributes={f"mserve.{k}": v for k, v in attributes.items() if v}):
            logging.getLogger("mserve").info("tracing on: spans go to %s", endpoint or tracing.endpoint_from_env())
    except tracing.TracingUnavailable as exc:
        raise SystemExit(f"error: {exc}")


def tracing_shutdown() -> None:
    from mserve.common import tracing

    tracing.shutdown()


def cmd_worker(args: argparse.Namespace) -> int:
    from mserve.workers.settings import WorkerSettings
    from mserve.workers.switching import serve

    settings = _settings_from_args(WorkerSettings, args)
    from mserve.common.model import CheckpointError
    from mserve.common.processor import UnsupportedModelError
    from mserve.common.pruning import PruningError

    _start_tracing(f"mserve-{settings.role}", settings.otlp_endpoint, worker_id=settings.worker_id)
    try:
        serve(settings)  # a worker, and after a role switch the same worker as its new role
    except KeyboardInterrupt:
        pass
    except (PruningError, UnsupportedModelError, CheckpointError) as exc:  # one line, no traceback
        raise SystemExit(f"error: {exc}")
    finally:
        tracing_shutdown()
    return 0


def add_gateway_arguments(p: argparse.ArgumentParser, *, standalone: bool = True) -> None:
    from mserve.gateway.settings import GatewaySettings

    def d(name: str) -> str:  # a default as --help shows it, read from GatewaySettings (its one place)
        value = GatewaySettings.model_fields[name].default
        whole_mib = isinstance(value, int) and value >= 2**20 and not value % 2**20
        return f"{value // 2**20} MiB" if whole_mib else f"{value:g}"

    if standalone:
        p.add_argument("--coordinator", help="the coordinator's client address (default tcp://127.0.0.1:5555); "
                                             "sharded coordinators: their addresses comma-separated, or redis://... "
                                             "to read them from the shard registry")
        p.add_argument("--direct-tokens", action="store_true", default=None,
                       help="take streamed tokens straight from the decode workers (needs the coordinator's "
                            "--token-report-every > 1 to pay); they connect to --tokens-host")
        p.add_argument("--tokens-host", help="address the workers reach this gateway's token sink on (default "
                                             "127.0.0.1)")
        p.add_argument("--media-store-host", help="put request images, audio clips and video files in a media store "
                                                  "bound on this address (the encode / unified workers pull them "
                                                  "from it) instead of sending their bytes through the coordinator; "
                                                  "default 127.0.0.1 (workers on this host); workers on other hosts "
                                                  "need an address of this host they reach; 'none': media inline")
        p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
        p.add_argument("--port", type=int, help="HTTP port (default 8000)")
        p.add_argument("--model", help="checkpoint folder for the tokenizer (default: the coordinator's model path)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests (default: none; "
                                     "better set MSERVE_API_KEY than put a key on a command line)")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: the coordinator's)")
    p.add_argument("--allowed-media-path", help="folder image paths / file:// URLs may be read from (default: "
                                                "none; data URLs always work)")
    p.add_argument("--allowed-media-domains",
                   help="hosts http(s) media URLs may be fetched from, comma-separated: 'cdn.example.com' that host "
                        "only, '.example.com' the names under example.com (default: every host with a public address; "
                        "private, loopback, link-local, multicast and reserved addresses are always refused)")
    for flag, kind, text in (
            ("media-max-bytes", int, "largest fetched media item; reading stops past it"),
            ("media-connect-timeout-s", float, "connect timeout of a media fetch"),
            ("media-read-timeout-s", float, "longest wait for the next bytes of a media fetch"),
            ("media-total-timeout-s", float, "whole time of one media URL, redirects included"),
            ("media-max-redirects", int, "redirect hops followed per media URL, each checked again"),
            ("media-max-concurrent-fetches", int,
             "media fetches running at once; one more waits --media-concurrency-wait-s, then 429"),
            ("media-concurrency-wait-s", float, "how long a media fetch waits for a free slot before a 429"),
            ("media-cache-bytes", int, "HTTP cache of fetched media, bytes (ETag / Last-Modified / max-age; 0 = off)")):
        p.add_argument(f"--{flag}", type=kind, help=f"{text} (default {d(flag.replace('-', '_'))})")
    p.add_argument("--allow-loopback-media-for-tests", action="store_true", default=None,
                   help="TEST ONLY: let media URLs reach 127.0.0.1 (no other private address), for tests that serve "
                        "media from a local server; never in a deployment")
    p.add_argument("--max-request-bytes", type=int,
                   help=f"largest HTTP body, images included (default {d('max_request_bytes')})")
    p.add_argument("--max-document-pages", type=int,
                   help=f"most pages a PDF `file` part may have; each page is an image "
                        f"(default {d('max_document_pages')})")
    p.add_argument("--document-dpi", type=int,
                   help="resolution PDF pages render at, longer side capped at 2048 pixels (default: the pixel "
                        "budget of the requested model's image processor, at least 72 DPI; 96 DPI for a model "
                        "without one; common/documents.py)")
    p.add_argument("--default-max-tokens", type=int,
                   help="max_tokens when a request names neither max_tokens nor max_completion_tokens "
                        "(default 256, common/sampling_rules.py)")
    p.add_argument("--request-timeout-s", type=float, help="a request not done by then ends with 504 (default 600)")
    p.add_argument("--access-log", action="store_true", default=None, help="log one line per HTTP request")
    p.add_argument("--coordinator-api-key",
                   help="the coordinator's client API key (its MSERVE_CLIENT_API_KEY), sent with every message to "
                        "it (default: $MSERVE_COORDINATOR_API_KEY, else $MSERVE_CLIENT_API_KEY, else none)")
    from mserve.common.tracing import add_argument as add_tracing_argument

    add_tracing_argument(p)


def cmd_gateway(args: argparse.Namespace) -> int:
    from mserve.gateway.app import serve
    from mserve.gateway.settings import GatewaySettings

    settings = _settings_from_args(GatewaySettings, args)
    _start_tracing("mserve-gateway", settings.otlp_endpoint)
    try:
        serve(settings)
    finally:
        tracing_shutdown()  # what is still buffered leaves before the process does
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from mserve.common.security import SecurityError, keygen

    try:
        public, secret = keygen(args.dir, args.name, force=args.force)
    except SecurityError as exc:
        raise SystemExit(f"error: {exc}")
    print(f"public key {public} (give it to the peers that must let this process in: their authorized keys "
          f"folder)\nsecret key {secret} (mode 0600; this process's curve_secret_key)")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from mserve.up import run_up

    return run_up(args)


def cmd_status(args: argparse.Namespace) -> int:
    from mserve.status import main as status_main

    return status_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "engine":
        from mserve.bench.engine_bench import main as engine_bench

        return engine_bench(args)
    if args.bench_cmd == "serve":
        from mserve.bench.serve import main as serve_bench

        return serve_bench(args)
    if args.bench_cmd == "compare":
        from mserve.bench.compare import main as compare_bench

        return compare_bench(args)
    raise SystemExit(f"unknown bench command {args.bench_cmd!r}")


def build_parser() -> argparse.ArgumentParser:
    from mserve.common.cpu_placement import add_argument as add_cpus_argument
    from mserve.common.cpu_placement import add_io_argument as add_io_cpus_argument
    from mserve.coordinator.cli import add_arguments as add_coordinator_arguments
    from mserve.common.served_models import SERVED_MODEL_TYPES
    from mserve.workers.cli import add_arguments as add_worker_arguments

    parser = argparse.ArgumentParser(prog="mserve", description="MServe: disaggregated serving for vision-language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny-model", help="build a random-weight checkpoint of a served family offline",
                       description="Write a complete save_pretrained folder (config, safetensors, trained byte-level "
                                   "BPE tokenizer, image processor, chat template) with random weights.")
    p.add_argument("out_dir", help="folder to write (created if missing)")
    p.add_argument("--arch", choices=SERVED_MODEL_TYPES, metavar="ARCH", default="llava",
                   help="model family, one of the served ones: " + ", ".join(SERVED_MODEL_TYPES) + " (default: llava)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="tiny (~1M params, tests) or small (~31M params, benchmarks); default tiny")
    p.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (default 0)")
    p.add_argument("--layout", choices=["both", "processor", "preprocessor"], default="both",
                   help="where the image processor settings go: both (nested processor_config.json plus "
                        "preprocessor_config.json, default), processor (what transformers' save_pretrained "
                        "writes now: nested processor_config.json only), preprocessor (older hub layout)")
    p.set_defaults(func=cmd_make_tiny_model)

    from mserve.generate import add_arguments as add_generate_arguments

    add_generate_arguments(sub.add_parser(
        "generate", help="run encode -> prefill -> decode in one process and print the answer",
        description="Load a local checkpoint folder (a family the README lists) and answer one prompt (with "
                    "images, audio clips or PDF pages)."))

    p = sub.add_parser("coordinator", help="run the coordinator (admission, routing, request state machine)",
                       description="Bind a ROUTER for clients (--bind) and one for workers (--worker-bind). Every "
                                   "flag can also be set as MSERVE_<NAME> in the environment.")
    add_coordinator_arguments(p)
    add_cpus_argument(p)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("worker", help="run one worker of a role: encode, prefill, decode or unified",
                       description="Connect to the coordinator's worker address and serve one role. Every flag can "
                                   "also be set as MSERVE_<NAME> in the environment.")
    add_worker_arguments(p)
    add_cpus_argument(p)
    add_io_cpus_argument(p)
    p.set_defaults(func=cmd_worker)

    from mserve import verify

    p = sub.add_parser("verify", help="prove a checkpoint token-exact against its own HF generate (the load-time probe)",
                       description=verify.__doc__)
    verify.add_arguments(p)
    p.set_defaults(func=verify.main)

    p = sub.add_parser("keygen", help="write a CURVE keypair for one process (NAME.key, NAME.key_secret)",
                       description="Write NAME.key (public, share it with the peers that must let this process "
                                   "in) and NAME.key_secret (secret, mode 0600) into DIR. Every process gets its "
                                   "own keypair; see docs/operations.md, Security.")
    p.add_argument("dir", help="folder to write the keys into (created 0700 if missing)")
    p.add_argument("--name", default="mserve", help="file name of the pair (default mserve)")
    p.add_argument("--force", action="store_true", help="replace an existing keypair of that name")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("up", help="start a whole local cluster: redis, coordinator and worker pools",
                       description="Start Redis (unless --redis/REDIS_URL is given), the coordinator and the worker "
                                   "pools; wait until every worker is ready; print the client address; stop "
                                   "everything on Ctrl-C or SIGTERM.")
    try:
        from mserve.up import add_up_arguments

        add_up_arguments(p)
    except ImportError:  # launcher not installed in this build
        pass
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="show the cluster: pools, workers, load, cache sizes, in-flight requests",
                       description="Ask the coordinator for STATUS and read the cluster's Redis (read only), and "
                                   "print pools, workers, cache sizes and the coordinator's counters as tables, or "
                                   "as one JSON object with --json. Either source may be down: what the other "
                                   "has is still shown. Exit code 1 when the coordinator does not answer, else 0.")
    from mserve.status import add_arguments as add_status_arguments

    add_status_arguments(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("switch-role", help="move a worker to another role: it drains, reloads, and registers again",
                       description="Ask the coordinator to switch WORKER_ID to ROLE (prefill, decode or unified). "
                                   "The worker drains first, so nothing in flight is lost, then reloads as ROLE "
                                   "under the same id. Refused, with the reason, for an encode worker, or the last "
                                   "worker the pipeline needs. See docs/architecture.md, Role switching.")
    from mserve.switch_role import add_arguments as add_switch_role_arguments
    from mserve.switch_role import main as switch_role_main

    add_switch_role_arguments(p)
    p.set_defaults(func=switch_role_main)

    p = sub.add_parser("gateway", help="serve the OpenAI API (/v1/chat/completions, /v1/models) over HTTP",
                       description="An OpenAI-compatible HTTP server in front of a coordinator: streaming (SSE) and "
                                   "non-streaming chat completions with images, /v1/models, /health and /metrics "
                                   "(Prometheus, the whole cluster's). Every flag can also be set as MSERVE_<NAME> "
                                   "in the environment (MSERVE_API_KEY for --api-key).")
    add_gateway_arguments(p)
    add_cpus_argument(p)
    p.set_defaults(func=cmd_gateway)

    from mserve.autoscale.cli import add_parser as add_autoscale_parser

    add_autoscale_parser(sub)

    p = sub.add_parser("bench", help="benchmarks (see bench/README.md)")
    bsub = p.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    from mserve.bench.engine_bench import add_arguments as add_engine_bench

    add_engine_bench(bsub.add_parser("engine", help="engine decode/prefill/KV-transfer throughput vs HF baselines"))
    from mserve.bench.compare import add_arguments as add_compare_bench
    from mserve.bench.serve import add_arguments as add_serve_bench

    add_serve_bench(bsub.add_parser(
        "serve", help="replay a trace against a cluster (zmq://) or an OpenAI-compatible server (http://)",
        description="Replay a seeded trace (Poisson/gamma arrivals or all at once) and write results.json, "
                    "report.md and PNG plots. See bench/README.md."))
    add_compare_bench(bsub.add_parser(
        "compare", help="launch each configuration in turn, run the same trace, print one comparison table",
        description="Configurations: disagg:XeYpZd, unified:N, hf-sequential, openai:http://HOST:PORT/v1, "
                    "zmq://HOST:PORT. Each runs the identical trace; ratios are against the first."))
    p.set_defaults(func=cmd_bench)
    return parser


def _pin(args: argparse.Namespace) -> None:
    """--cpus (else $MSERVE_CPUS) for the commands that take it, and a worker's --io-cpus (else
    $MSERVE_IO_CPUS): before any model or thread starts."""
    if not hasattr(args, "cpus"):
        return
    from mserve.common.cpu_placement import format_cpu_list, pin, pin_io

    text = args.cpus or os.environ.get("MSERVE_CPUS")
    io_text = (args.io_cpus or os.environ.get("MSERVE_IO_CPUS")) if hasattr(args, "io_cpus") else None
    log = logging.getLogger("mserve")
    try:
        io = pin_io(io_text) if io_text else ()  # first: checked against the cores before `pin` narrows them
        cpus = pin(text) if text else ()
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}")
    if cpus:
        log.info("running on CPU core(s) %s%s", format_cpu_list(cpus),
                 f", IO threads on {format_cpu_list(io)}" if io else "")
    elif io:
        log.info("IO threads on CPU core(s) %s", format_cpu_list(io))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    _pin(args)
    from mserve.common.perf import tune_malloc

    tune_malloc()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
