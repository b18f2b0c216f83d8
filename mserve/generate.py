"""`mserve generate`: one prompt through encode -> prefill -> decode in one process, no cluster; the quickest
way to see a checkpoint answer (images, audio clips, PDF pages) and the engine's tokens."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mserve.common import sampling_rules as rules
from mserve.common.documents import MAX_DOCUMENT_PAGES
from mserve.common.policy import DEFAULT_ENGINE
from mserve.common.pruning import add_argument as add_pruning_argument
from mserve.common.serving_defaults import add_dtype_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--prompt", required=True, help="the user's text")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="an image file; repeat for more")
    p.add_argument("--document", action="append", default=[], metavar="PATH",
                   help="a PDF: each page an image, after the --image ones; repeat for more")
    p.add_argument("--max-document-pages", type=int, default=MAX_DOCUMENT_PAGES,
                   help=f"most pages a --document may have (default {MAX_DOCUMENT_PAGES})")
    p.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="an audio file (wav, mp3, flac, ogg) for a model that takes audio; repeat for more")
    p.add_argument("--max-tokens", type=int, default=rules.MAX_TOKENS,
                   help=f"tokens to generate at most (default {rules.MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=rules.TEMPERATURE, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=rules.TOP_K, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=rules.TOP_P, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampled output")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_dtype_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks (default 1024)")
    p.add_argument("--block-size", type=int, default=DEFAULT_ENGINE.block_size,
                   help=f"tokens per KV block (default {DEFAULT_ENGINE.block_size})")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_token_ids": [...], "token_ids": [...], "text": "..."} instead of the text')
    add_pruning_argument(p, "Changes the answer (see docs/operations.md).")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Answer one prompt in this process and print it (or its ids with --json)."""
    from mserve.common.documents import DocumentError, DocumentLimits, model_page_budget, render_pdf_file
    from mserve.common.images import ImageError
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.paged_attention import exact_setting
    from mserve.workers.sequence import SamplingParams

    images, clips = [], []
    for flag, paths, out in (("--image", args.image, images), ("--audio", args.audio, clips)):
        for path in paths:
            p = Path(path)
            if not p.is_file():
                raise SystemExit(f"error: {flag} {path}: no such file")
            out.append(p.read_bytes())
    try:  # each PDF's pages, rendered as the gateway renders them (the model's pixel budget), after the images
        limits = DocumentLimits(max_pages=args.max_document_pages, budget=model_page_budget(args.model))
        for path in args.document:
            images.extend(render_pdf_file(path, limits, f"--document {path}"))
    except DocumentError as exc:
        raise SystemExit(f"error: {exc}")
    try:
        builder = PromptBuilder(args.model, visual_token_pruning=args.visual_token_pruning)
        prompt = builder.prepare_text(args.prompt, images, clips)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        engine = Engine(EngineConfig(args.model, device=args.device, threads=args.threads, dtype=args.dtype,
                                     exact_attention=exact_setting(args.attention),
                                     num_blocks=args.num_blocks, block_size=args.block_size,
                                     visual_token_pruning=builder.visual_token_pruning))
        t0 = time.perf_counter()
        engine.add_request("cli", prompt.prompt_ids, images=prompt.images, sampling=sampling)
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
