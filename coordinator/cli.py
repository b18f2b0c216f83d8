"""`mserve coordinator`'s flags: every CoordinatorSettings field a flag can set (the rest come from
MSERVE_* environment variables; docs/operations.md lists both). mserve/cli.py runs the command."""

from __future__ import annotations

import argparse
import math


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mserve.common.policy import CLASS_AGING_S, DEFAULT_LIMITS
    from mserve.common.pruning import add_argument as add_pruning_argument
    from mserve.common.tracing import add_argument as add_tracing_argument

    p.add_argument("--model", help="the default model's local checkpoint folder (tokenizer, chat template, processor "
                                   "rules), for requests that name no model; every other model is served as its "
                                   "workers register, from the folder each names (docs/operations.md, 'Several "
                                   "models')")
    p.add_argument("--model-name", help="the default model's served name and Redis cache key (default: the model "
                                        "path); workers of this model must use the same --model-name")
    p.add_argument("--bind", help="client address (default tcp://127.0.0.1:5555)")
    p.add_argument("--worker-bind", help="worker address (default tcp://127.0.0.1:5556)")
    p.add_argument("--redis", help="redis URL, e.g. redis://127.0.0.1:6379/0 (optional: without it routing uses "
                                   "heartbeats only)")
    p.add_argument("--redis-timeout-s", type=float,
                   help="seconds one Redis call may wait before Redis counts as down (default 0.5); the loop never "
                        "waits on Redis: the announcement, loads poll and lease writes run on a thread of their own, "
                        "and routing reads its cache hints only while Redis answers")
    p.add_argument("--shard-id",
                   help="run as one of several coordinator shards under this name: it announces itself in Redis "
                        "(needs --redis), workers connect to every shard found there, and clients given "
                        "--coordinator redis://... spread requests over the shards (docs/scaling.md)")
    p.add_argument("--advertise", help="client address a shard announces, when --bind is a wildcard (tcp://*:...)")
    p.add_argument("--worker-advertise",
                   help="worker address a shard announces, when --worker-bind is a wildcard")
    p.add_argument("--route-choices", type=int,
                   help="route each stage among this many workers drawn at random plus the cache holders, instead "
                        "of among all (0, the default); 2 for sharded coordinators, which would otherwise all pick "
                        "the same least busy worker between load reports")
    p.add_argument("--load-poll-s", type=float,
                   help="read the worker loads from Redis this often, besides their heartbeats (default 0.25; 0: "
                        "heartbeats only, the cheaper choice for many workers and shards)")
    p.add_argument("--token-report-every", type=int,
                   help="workers report a request's tokens here every N tokens instead of every step, and stream "
                        "them straight to clients that opened a token sink (Client(direct_tokens=True), the "
                        "gateway's --direct-tokens); default 1: every token through the coordinator")
    p.add_argument("--stage-timeout-s", type=float,
                   help="re-run a stage that makes no progress this long (default 60; a request merely queued at a "
                        "live worker is not re-run)")
    p.add_argument("--dead-after-s", type=float, help="declare a silent worker dead after this long (default 5)")
    p.add_argument("--role-switching", action="store_true", default=None,
                   help="move a prefill or decode worker to the other pool when the load stays lopsided: it drains "
                        "first, so nothing is lost (coordinator/role_policy.py; docs/architecture.md, \"Role "
                        "switching\"). Default off: roles change only by `mserve switch-role`")
    p.add_argument("--kv-hand-back", action="store_true", default=None,
                   help="decode workers hand each finished reply's KV blocks back to the prefill worker, so a "
                        "conversation's next turn finds its prompt and the reply cached (default off)")
    p.add_argument("--local-prefill-tokens", type=int,
                   help="conditional disaggregation: when the chosen prefill worker already has this many prompt "
                        "tokens waiting, a decode worker with room and fewer waiting prefills the prompt itself "
                        "and decodes it on, with no KV transfer (default 0: never)")
    p.add_argument("--adaptive-lending", action="store_true", default=None,
                   help="lend a prompt to a decode worker only where the time it saves there exceeds the time its "
                        "compute costs the requests that worker holds (counted in prompt tokens; overrides "
                        "--local-prefill-tokens). In the scale model it cut the image trace's TTFT p99 by 40-50 %% "
                        "in both cost regimes, for +30 %% throughput where prefill is the slower stage and -6 to 0 %% "
                        "where decode is (bench/README.md, \"Adaptive lending\"). Default off")
    p.add_argument("--spread-encode", choices=("on", "off"), default=None,
                   help="share a multi-image request's images with idle encode workers, which encode their parts "
                        "at the same time (default on)")
    p.add_argument("--encode-single-flight", nargs="?", const="on", choices=("on", "off"), default=None,
                   help="at most one encode in flight per image across the cluster: a request for an image being "
                        "encoded waits for that encode and reads it back from its holder (default on)")
    p.add_argument("--no-encode-single-flight", dest="encode_single_flight", action="store_const", const="off",
                   help="--encode-single-flight off")
    p.add_argument("--prefix-skip", choices=("on", "off"), default=None,
                   help="do not encode (or fetch) images whose placeholders the chosen prefill worker's cached "
                        "prefix holds whole (default on)")
    p.add_argument("--max-waiting-requests", type=int,
                   help="requests waiting for their first token, at most; past it the lowest class is shed with an "
                        "overloaded error and a retry-after hint (default 256)")
    p.add_argument("--max-stages-per-worker", type=int,
                   help="stages kept open at once on one encode, prefill or unified worker; the rest wait at the "
                        "coordinator, best class first, for whichever worker frees first (default 0: no cap)")
    p.add_argument("--class-aging-s", type=float,
                   help="a request waiting at the coordinator longer than this goes before every class "
                        f"(default {CLASS_AGING_S:g}; each worker orders its own prompt queue by its own --class-aging-s)")
    limits = DEFAULT_LIMITS  # the defaults shown are the settings' own (common/policy.py)
    side = math.isqrt(limits.max_image_pixels)
    for limit, help_ in (("max-prompt-tokens", limits.max_prompt_tokens), ("max-tokens", limits.max_tokens),
                         ("max-image-bytes", f"{limits.max_image_bytes / 2**20:g} MiB"),
                         ("max-image-pixels", f"{side}*{side}" if side * side == limits.max_image_pixels
                          else limits.max_image_pixels),
                         ("max-images-per-request", limits.max_images_per_request),
                         ("max-video-frames", f"{limits.max_video_frames}; a video file is sampled down to it"),
                         ("max-audio-bytes", f"{limits.max_audio_bytes / 2**20:g} MiB per audio clip"),
                         ("max-audio-per-request", limits.max_audio_per_request)):
        p.add_argument(f"--{limit}", type=int, help=f"admission limit (default {help_})")
    p.add_argument("--max-audio-seconds", type=float,
                   help=f"admission limit, seconds of one audio clip (default {limits.max_audio_seconds:g})")
    p.add_argument("--video-fps", type=float,
                   help=f"frames sampled per second of a video file (Qwen3-VL: by its video processor's own "
                        f"rule with this fps; default {limits.video_fps:g})")
    p.add_argument("--client-api-key", help="require this key in every client message (default: "
                                            "$MSERVE_CLIENT_API_KEY, else none; better set the variable than put a "
                                            "key on a command line)")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="CURVE on the worker link: this coordinator's .key_secret file (`mserve keygen`); needs "
                        "--curve-authorized-keys")
    p.add_argument("--curve-authorized-keys", metavar="DIR",
                   help="folder of the public keys (*.key) of the workers allowed in; any other is refused")
    add_tracing_argument(p)
    p.add_argument("--adaptive-pruning", metavar="CLASS=RATIO,...",
                   help="opt-in SLO-adaptive visual-token pruning: the keep ratio each listed latency class's new "
                        "requests get while its predicted TTFT breaks its --ttft-slo-ms objective, e.g. "
                        "interactive=0.5,batch=0.25 (LLaVA; requests through encode workers; default off)")
    p.add_argument("--ttft-slo-ms", metavar="CLASS=MS,...",
                   help="TTFT objective per latency class for --adaptive-pruning and --variant-groups, e.g. "
                        "interactive=2000,batch=10000")
    p.add_argument("--adaptive-pruning-hold-s", type=float,
                   help="adaptive pruning lifts once the predicted TTFT stays below 0.7x the objective this long "
                        "(default 2)")
    p.add_argument("--variant-groups", metavar="GROUP=SMALL,LARGE;...",
                   help="opt-in model-version routing: a request whose model names GROUP goes to one of its served "
                        "variants (listed smallest first): batch to the largest live one, interactive to a smaller "
                        "one while the larger one's predicted TTFT breaks --ttft-slo-ms interactive=MS (required), "
                        "back up once it stays below 0.7x that for --variant-hold-s; the reply names the variant")
    p.add_argument("--variant-hold-s", type=float,
                   help="interactive traffic moves back to a larger variant after its prediction stays below 0.7x "
                        "the objective this long (default 2)")
    add_pruning_argument(p, "Admission counts placeholders at this ratio; encode and unified workers with "
                            "another are refused.")
