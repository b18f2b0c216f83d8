"""`mserve bench engine`: the stage engine's throughput beside two Hugging Face baselines, in one run.

Same checkpoint, same threads, same prompts, EOS disabled so every request generates exactly
--new-tokens tokens. Baselines: sequential `generate` (one request at a time) and transformers'
own continuous batching (`generate_batch`, text-only: it takes no image embeddings).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from typing import Any

log = logging.getLogger("mserve.bench.engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder (use a `small` tiny model)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="text prompt length (default 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for every system (default 1)")
    p.add_argument("--sequential-requests", type=int, default=4,
                   help="requests timed for the sequential generate baseline (its rate does not depend on batch)")
    p.add_argument("--skip-generate-batch", action="store_true", help="skip transformers' generate_batch baseline")
    p.add_argument("--compile", action="store_true",
                   help="run the engine's decode steps through torch.compile (EngineConfig.compile); "
                        "the warm-up pays the compilation (10-30 s)")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")


def _prompts(n: int, length: int, vocab: int, specials: set[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pool = [t for t in range(vocab) if t not in specials]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def _throughput(num_requests: int, out_tokens: int, t0: float, first_token_at: list[float], end: float) -> dict:
    """End-to-end rate, and the decode-phase rate once every request has its first token.

    The same definition for the engine and for generate_batch (from its per-token timestamps), so
    prefill scheduling differences do not leak into the decode figure.
    """
    decode_start = max(first_token_at)
    decode_tokens = out_tokens - num_requests
    return {"wall_s": end - t0, "output_tokens": out_tokens, "tokens_per_s": out_tokens / (end - t0),
            "decode_tokens_per_s": decode_tokens / (end - decode_start) if end > decode_start else 0.0}


def _engine_run(engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    from mserve.workers.sequence import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{len(prompts)}-{i}", p, sampling=params)
    first: dict[str, float] = {}
    out_tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        out_tokens += len(outs)
        for o in outs:
            first.setdefault(o.request_id, now)
    return _throughput(len(prompts), out_tokens, t0, list(first.values()), time.perf_counter())


def _hf_sequential(model, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    import torch

    t0 = time.perf_counter()
    n = 0
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
        n += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall}


def _hf_generate_batch(model, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    model.generate_batch(prompts[:2], generation_config=cfg)  # warm-up: its cache sizing is not our cost
    t0 = time.perf_counter()
    # warmup=False: its warm-up pass (seconds of graph/cache priming) ran in the call above.
    out = model.generate_batch(prompts, generation_config=cfg, record_timestamps=True, warmup=False)
    end = time.perf_counter()
    n = sum(len(o.generated_tokens) for o in out.values())
    firsts = [o.timestamps[0] if o.timestamps else end for o in out.values()]
    return _throughput(len(prompts), n, t0, firsts, max((o.timestamps or [end])[-1] for o in out.values()))


def _image_prefill_and_kv(args, engine_factory, image_prompt) -> dict[str, float]:
    from mserve.workers.sequence import SamplingParams

    pre, dec = engine_factory(), engine_factory()
    ids, images = image_prompt
    # Warm once so first-call allocations don't count.
    pre.add_request("warm", ids, images=images, sampling=SamplingParams(max_tokens=1))
    pre.run_until_done()
    t0 = time.perf_counter()
    encoded = pre.encode(images)
    encode_s = time.perf_counter() - t0
    pre.add_request("img", ids, encoded=encoded, image_hashes=["bench"], prefill_only=True,
                    sampling=SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    pre.run_until_done()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    payload = pre.export_kv("img")
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec.import_kv(payload)
    import_s = time.perf_counter() - t0
    kv_bytes = payload.kv.numel() * payload.kv.element_size()
    return {"prompt_tokens": len(ids), "encode_s": encode_s, "prefill_s": prefill_s,
            "prefill_tokens_per_s": len(ids) / prefill_s, "kv_export_s": export_s, "kv_import_s": import_s,
            "kv_bytes": kv_bytes, "kv_transfer_vs_prefill": (export_s + import_s) / prefill_s}


def _bench_image(width: int = 1280, height: int = 720) -> bytes:
    """A deterministic photo-sized image (PIL's Mandelbrot effect) as PNG bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.effect_mandelbrot((width, height), (-2.0, -1.2, 1.0, 1.2), 80).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForImageTextToText

    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    builder = PromptBuilder(args.model)
    tok = builder.tokenizer
    specials = set(tok.all_special_ids) | {builder.family.image_token_id}
    prompts = _prompts(max(batches), args.prompt_tokens, len(tok), specials)
    need = max(batches) * (args.prompt_tokens + args.new_tokens + 16)

    def engine_factory() -> Engine:
        return Engine(EngineConfig(args.model, num_blocks=max(512, need // 16 + 64), block_size=16,
                                   max_num_seqs=max(batches), max_num_batched_tokens=4096,
                                   enable_prefix_caching=False, compile=args.compile))

    results: dict[str, Any] = {"model": args.model, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                               "new_tokens": args.new_tokens, "engine": {}, "generate_batch": {}}
    engine = engine_factory()
    _engine_run(engine, prompts[:2], 4)  # warm-up
    if args.compile:  # a batch of one is a graph of its own (dynamo specialises size 1)
        _engine_run(engine, prompts[:1], 4)
    for b in batches:
        log.info("engine: batch %d", b)
        results["engine"][b] = _engine_run(engine, prompts[:b], args.new_tokens)

    hf = AutoModelForImageTextToText.from_pretrained(args.model).eval()
    log.info("baseline: sequential generate x%d", args.sequential_requests)
    _hf_sequential(hf, prompts[:1], 4)  # warm-up
    results["sequential_generate"] = _hf_sequential(hf, prompts[: args.sequential_requests], args.new_tokens)
    if not args.skip_generate_batch:
        for b in batches:
            log.info("baseline: generate_batch batch %d", b)
            try:
                results["generate_batch"][b] = _hf_generate_batch(hf, prompts[:b], args.new_tokens)
            except Exception as exc:  # a baseline that cannot run is reported, not fatal
                results["generate_batch"][b] = {"error": f"{exc.__class__.__name__}: {exc}"}

    image = _bench_image()
    image_prompt = builder.prepare_text("Describe this image in detail.", [image])
    log.info("image prefill + KV export/import (%d prompt tokens)", len(image_prompt.prompt_ids))
    results["image"] = _image_prefill_and_kv(args, engine_factory, (image_prompt.prompt_ids, [image]))
    print(render(results))
    if args.json_out:
        import os

        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def render(r: dict[str, Any]) -> str:
    seq = r["sequential_generate"]["tokens_per_s"]
    lines = [f"# mserve bench engine — {r['model']} ({r['threads']} thread(s), {r['prompt_tokens']} prompt tokens, "
             f"{r['new_tokens']} new tokens/request)", "",
             "Decode tok/s counts tokens after every request of the batch has its first token; end-to-end "
             "includes prefill. Sequential generate runs one request at a time (its rate is per request).", "",
             "| batch | engine decode tok/s | generate_batch decode tok/s | sequential generate tok/s | "
             "decode vs generate_batch | decode vs sequential | engine e2e tok/s | generate_batch e2e tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, e in r["engine"].items():
        gb = r["generate_batch"].get(b, {})
        gbd, gbe = gb.get("decode_tokens_per_s", 0.0), gb.get("tokens_per_s", 0.0)
        note = f" ({gb['error'][:40]})" if "error" in gb else ""
        lines.append(f"| {b} | {e['decode_tokens_per_s']:.1f} | {gbd:.1f}{note} | {seq:.1f} | "
                     f"{_ratio(e['decode_tokens_per_s'], gbd):.2f}x | {_ratio(e['decode_tokens_per_s'], seq):.2f}x | "
                     f"{e['tokens_per_s']:.1f} | {gbe:.1f} |")
    im = r["image"]
    lines += ["", f"Image prompt ({im['prompt_tokens']} tokens, 1280x720): encode {im['encode_s'] * 1e3:.0f} ms, "
              f"prefill {im['prefill_s'] * 1e3:.0f} ms = {im['prefill_tokens_per_s']:.0f} tok/s; "
              f"KV export {im['kv_export_s'] * 1e3:.1f} ms + import {im['kv_import_s'] * 1e3:.1f} ms "
              f"for {im['kv_bytes'] / 2**20:.1f} MiB = {im['kv_transfer_vs_prefill'] * 100:.1f}% of prefill time"]
    return "\n".join(lines)
