"""The `mserve` command: one entry point, one subcommand per role (names are a contract, see DESIGN.md).

Heavy imports (torch, transformers) happen inside each handler so `mserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # transformers' progress bars and advice are noise in a CLI that prints JSON.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from common.tiny_model import make_tiny_model

    t0 = time.perf_counter()
    out = make_tiny_model(args.out_dir, args.arch, args.size, seed=args.seed)
    print(f"wrote {args.arch} ({args.size}, seed {args.seed}) checkpoint to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from common.model import ImageError
    from common.prompt import PromptBuilder
    from workers.engine import Engine, EngineConfig
    from workers.sequence import SamplingParams

    images = []
    for path in args.image:
        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"error: --image {path}: no such file")
        images.append(p.read_bytes())
    try:
        builder = PromptBuilder(args.model)
        prompt = builder.prepare_text(args.prompt, images)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        engine = Engine(EngineConfig(args.model, device=args.device, threads=args.threads,
                                     num_blocks=args.num_blocks, block_size=args.block_size))
        t0 = time.perf_counter()
        engine.add_request("cli", prompt.prompt_ids, images=images, sampling=sampling)
        tokens = engine.run_until_done()["cli"]
        elapsed = time.perf_counter() - t0
    except (ValueError, ImageError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}")
    text = builder.decode(tokens)
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt.prompt_ids, "token_ids": tokens, "text": text}))
    else:
        print(text)
        print(f"[{len(prompt.prompt_ids)} prompt tokens, {len(tokens)} generated in {elapsed:.2f}s]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "engine":
        from bench.engine_bench import main as engine_bench

        return engine_bench(args)
    raise SystemExit(f"unknown bench command {args.bench_cmd!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mserve", description="MServe: disaggregated serving for vision-language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny-model", help="build a random-weight llava or qwen2_vl checkpoint offline",
                       description="Write a complete save_pretrained folder (config, safetensors, trained byte-level "
                                   "BPE tokenizer, image processor, chat template) with random weights.")
    p.add_argument("out_dir", help="folder to write (created if missing)")
    p.add_argument("--arch", choices=["llava", "qwen2_vl"], default="llava", help="model family (default: llava)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="tiny (~1M params, tests) or small (~31M params, benchmarks); default tiny")
    p.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (default 0)")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="run encode -> prefill -> decode in one process and print the answer",
                       description="Load a local llava-hf or Qwen2-VL folder and answer one prompt (with images).")
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--prompt", required=True, help="the user's text")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="an image file; repeat for more")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampled output")
    p.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16); default cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_token_ids": [...], "token_ids": [...], "text": "..."} instead of the text')
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmarks (see bench/README.md)")
    bsub = p.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    from bench.engine_bench import add_arguments as add_engine_bench

    add_engine_bench(bsub.add_parser("engine", help="engine decode/prefill/KV-transfer throughput vs HF baselines"))
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from common.perf import tune_malloc

    tune_malloc()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
