"""`mserve worker`'s flags: every WorkerSettings field a flag can set (the rest come from MSERVE_*
environment variables; docs/operations.md lists both). mserve/cli.py runs the command."""

from __future__ import annotations

import argparse

from mserve.common.serving_defaults import add_dtype_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mserve.common.policy import CLASS_AGING_S, DEFAULT_ENGINE
    from mserve.common.pruning import add_argument as add_pruning_argument
    from mserve.common.tracing import add_argument as add_tracing_argument

    p.add_argument("--role", choices=["encode", "prefill", "decode", "unified"], help="which stage(s) to run")
    p.add_argument("--model", help="local checkpoint folder")
    p.add_argument("--model-name", help="the served model name clients ask for ('model') and the Redis cache key "
                                        "(default: the model path); one coordinator serves several models, each "
                                        "by the name its workers give")
    p.add_argument("--heartbeat-s", type=float,
                   help="seconds between heartbeats (with the load) to every coordinator (default 0.25; 1 for a "
                        "cluster of many workers and coordinator shards: each heartbeat costs every shard CPU)")
    p.add_argument("--coordinator",
                   help="the coordinator's worker address (default tcp://127.0.0.1:5556); several coordinator shards: "
                        "their addresses comma-separated, or redis://... to connect to every shard registered there "
                        "as they come and go (shards announced in --redis are always joined too)")
    p.add_argument("--redis", help="redis URL (registry, load, cache indexes)")
    p.add_argument("--redis-timeout-s", type=float,
                   help="seconds one Redis call may wait before Redis counts as down for a second (default 0.5); "
                        "every Redis call runs on a thread of its own, so a slow Redis never holds a step or a "
                        "heartbeat to the coordinator")
    p.add_argument("--worker-id", help="unique id (default role-host-pid)")
    p.add_argument("--device", help="cpu (default) or cuda, cuda:N")
    add_dtype_arguments(p)
    p.add_argument("--compile", action="store_true", default=None,
                   help="run decode steps through torch.compile (inductor): about 1.35x decode speed at batch 1 "
                        "on the CPU, none from batch 16; the first decode steps compile for 15-50 s (cached in "
                        "TORCHINDUCTOR_CACHE_DIR); float32, or --attention padded (default off)")
    p.add_argument("--threads", type=int, help="torch threads (default 1)")
    p.add_argument("--transfer", choices=["auto", "shm", "tcp", "torch"],
                   help="tensor transfer backend (default auto: shm on the same host, tcp otherwise)")
    p.add_argument("--host", help="address peers reach this worker's data plane at (default 127.0.0.1)")
    p.add_argument("--num-blocks", type=int, help=f"KV pool blocks (default {DEFAULT_ENGINE.num_blocks})")
    p.add_argument("--block-size", type=int, help=f"tokens per KV block (default {DEFAULT_ENGINE.block_size})")
    p.add_argument("--gpu-memory-fraction", type=float, metavar="F",
                   help="this worker's share of its device's memory, in (0, 1]: the KV pool is sized to fit it "
                        "(--num-blocks is then ignored) and, on CUDA, the allocator is capped at it; several "
                        "workers can share one GPU (default: unset, --num-blocks as given)")
    p.add_argument("--device-memory-gb", type=float, metavar="GIB",
                   help="the memory --gpu-memory-fraction is of: required on CPU, on CUDA it overrides the device's")
    p.add_argument("--mig-device", metavar="UUID",
                   help="run on this MIG instance (MIG-..., as `nvidia-smi -L` lists it): CUDA_VISIBLE_DEVICES")
    p.add_argument("--max-num-seqs", type=int, help=f"running requests at most (default {DEFAULT_ENGINE.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, help=f"token budget per engine step (default {DEFAULT_ENGINE.max_num_batched_tokens})")
    p.add_argument("--max-prefill-tokens", type=int,
                   help="prompt tokens per engine step, the prefill chunk cap: a long prompt delays a short one "
                        "or a running stream by at most one chunk (default "
                        f"{DEFAULT_ENGINE.max_prefill_tokens})")
    p.add_argument("--class-aging-s", type=float,
                   help="a prompt queued on this worker longer than this goes before every class, so batch prompts "
                        f"do not starve behind interactive ones (default {CLASS_AGING_S:g}; the "
                        "coordinator's own --class-aging-s orders the requests it holds)")
    p.add_argument("--max-encode-images", type=int,
                   help="images per vision forward on an encode worker, at most; interactive ones first (default "
                        "1 on the CPU, where a batch is no quicker per image and holds every image back to the "
                        "last; 8 on CUDA)")
    p.add_argument("--embedding-cache-mb", type=float,
                   help="L1 embedding cache: an encode worker's own memory, 0 for none (default 512)")
    p.add_argument("--host-embedding-cache-mb", type=float,
                   help="L2 embedding cache: tmpfs files shared by the host's encode workers, surviving their "
                        "restarts; 0 for none (default 1024)")
    p.add_argument("--host-embedding-cache-dir", metavar="DIR",
                   help="where the L2 cache lives (default /dev/shm/mserve-embeddings)")
    p.add_argument("--prefix-caching", dest="enable_prefix_caching", choices=["on", "off"],
                   type=str.lower, help="keep freed prompt blocks for reuse by later prompts (default on)")
    p.add_argument("--state-snapshots", type=int, metavar="N",
                   help="hybrid (linear-attention) models: copies of the per-sequence state kept at block "
                        "boundaries for prefix hits, LRU; each costs one sequence's state (`mserve status`); "
                        "0 turns prefix caching off for them (default 32)")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="CURVE on the coordinator link and the data plane: this worker's .key_secret file "
                        "(`mserve keygen`); needs --curve-server-key and --curve-authorized-keys")
    p.add_argument("--curve-server-key", metavar="FILE", help="the coordinator's public .key file")
    p.add_argument("--curve-authorized-keys", metavar="DIR",
                   help="folder of the public keys (*.key) of the workers allowed to fetch from this one")
    add_tracing_argument(p)
    add_pruning_argument(p, "Encode and unified workers prune; must equal the coordinator's.")
    p.add_argument("--fetch-timeout-s", type=float,
                   help="seconds a fetch of another worker's KV blocks or embeddings may wait before that request "
                        "fails, retryably (default 10)")
    p.add_argument("--drain-timeout-s", type=float,
                   help="SIGTERM drains the worker (no new work, finish what it has, exit when the coordinator "
                        "releases it); past this many seconds it exits anyway (default 25; SIGTERM twice: now)")
