"""A 7B-class random-weight LLaVA built on the device (never downloaded), for the GPU check
(bench/lab/gpu/check.py): the engine's decode throughput at several batch sizes and a short in-process
serving run, beside HF's own batched `generate` on the same device and the same weights, with memory
per role.

The checkpoint folder holds what the engine reads besides weights (config, tiny tokenizer, the
CLIP processor at 336 px): the weights are drawn straight into device memory by transformers'
own initialisation and handed to the engine as a model object, so nothing of 14 GB is written.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("lab.gpu.check")

# llava-hf/llava-1.5-7b-hf's shapes: CLIP ViT-L/14 at 336 px and a Llama-2-7B (Vicuna) text model.
# "tiny" stands in on a CPU dry run (the same code path, a model that builds in a second), "small" for CPU figures.
BIG_SIZES: dict[str, dict[str, int]] = {
    "7b": dict(v_hidden=1024, v_inter=4096, v_layers=24, v_heads=16, image_size=336,
               hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32, vocab=32064),
    # `mserve make-tiny-model --size small`'s shapes (the CPU benchmark model, ~31M parameters).
    "small": dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=336,
                  hidden=512, inter=1376, layers=8, heads=8, kv_heads=4, vocab=4000),
    "tiny": dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=112,
                 hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=1000),
}


def build_big_llava(out: Path, size: str, device: str) -> tuple[Path, torch.nn.Module]:
    """(checkpoint folder without weights, bf16 model on `device` ready for the engine)."""
    from transformers import AutoModelForImageTextToText

    from mserve.common.tiny_families import FAMILIES
    from mserve.common.tiny_families.base import VOCAB_SIZES
    from mserve.workers.model_loading import use_paged_attention

    family, dims = FAMILIES["llava"], BIG_SIZES[size]
    out.mkdir(parents=True, exist_ok=True)
    tok = family.tokenizer(VOCAB_SIZES["tiny"])
    config = family.config(dims, tok, 0.02)
    config.text_config.vocab_size = dims["vocab"]  # the real vocabulary's cost in the LM head
    family.save_processor(out, dims, tok, "both")
    config.save_pretrained(out)
    family.generation_config(tok).save_pretrained(out)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config = family.generation_config(tok)
    use_paged_attention(model.eval())
    log.info("built %s llava: %.2fB parameters on %s in %.1f s", size,
             sum(p.numel() for p in model.parameters()) / 1e9, device, time.perf_counter() - t0)
    return out, model


def part_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Weight bytes an encode worker keeps (vision tower + projector) and a prefill/decode worker keeps."""
    from mserve.workers.model_loading import _VISION_MODULES

    vision = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if any(f".{m}." in f".{n}" for m in _VISION_MODULES))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"vision_weights": vision, "text_weights": total - vision}


def text_prompts(n: int, length: int, tokenizer, image_token_id: int, seed: int = 0) -> list[list[int]]:
    """n random text prompts of ragged lengths (`length` / 2 to 3 `length` / 2, so a decode batch holds
    many context lengths, as in serving) from the tokenizer's vocabulary, no special or image token."""
    rng = random.Random(seed)
    specials = set(tokenizer.all_special_ids) | {image_token_id}
    pool = [t for t in range(len(tokenizer)) if t not in specials]
    return [[rng.choice(pool) for _ in range(length // 2 + rng.randrange(max(length, 1)))] for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_batch(engine, prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, float]:
    """Decode tok/s once every request has its first token (as `mserve bench engine` counts)."""
    from mserve.workers.sequence import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{len(prompts)}-{i}-{t0}", p, sampling=params)
    first, tokens = {}, 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        tokens += len(outs)
        for o in outs:
            first.setdefault(o.request_id, now)
    end = time.perf_counter()
    start = max(first.values())
    return {"wall_s": end - t0, "tokens": tokens, "tokens_per_s": tokens / (end - t0),
            "decode_tokens_per_s": (tokens - len(prompts)) / (end - start) if end > start else 0.0}


def hf_batch(model, prompts: list[list[int]], new_tokens: int, device: str, pad_id: int) -> dict[str, float]:
    """HF's own batched generate (left-padded, one call) on the same weights: end-to-end tok/s, and the
    decode rate from the time of a 1-token call subtracted (its prefill)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id)
        _sync(device)
        return time.perf_counter() - t0

    prefill_s, wall = run(1), run(new_tokens)
    tokens = len(prompts) * new_tokens
    decode_s = max(wall - prefill_s, 1e-9)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": (tokens - len(prompts)) / decode_s}


def serving_requests(n: int, prompt_tokens: int, builder, image_token_id: int,
                     questions: list[str] | tuple[str, ...]) -> list[tuple[list[int], list[bytes]]]:
    """The serving run's requests: every other one a 640x480 image with one of `questions`, the rest
    text prompts of about `prompt_tokens` tokens."""
    import numpy as np

    from mserve.bench.images import ImageFactory

    images = ImageFactory(np.random.default_rng(1), use_photos=False, distinct=True)
    out: list[tuple[list[int], list[bytes]]] = []
    for i, p in enumerate(text_prompts(n, prompt_tokens, builder.tokenizer, image_token_id, seed=1)):
        if i % 2:
            image = images.make((640, 480))
            out.append((builder.prepare_text(questions[i % len(questions)], [image]).prompt_ids, [image]))
        else:
            out.append((p, []))
    return out


def serving_run(engine, requests: list[tuple[list[int], list[bytes]]], rate: float, new_tokens: int,
                seed: int = 0) -> dict[str, Any]:
    """Poisson arrivals at `rate` req/s of (prompt ids, images) into one engine (a unified worker
    without its sockets). TTFT and TPOT per request, percentiles over the run."""
    from mserve.workers.sequence import SamplingParams

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(rate)
        arrivals.append(t)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    sent, started, first, last, count = 0, {}, {}, {}, {}
    while sent < len(requests) or engine.has_unfinished():
        while sent < len(requests) and arrivals[sent] <= time.perf_counter() - t0:
            rid = f"serve-{sent}"
            prompt, images = requests[sent]
            engine.add_request(rid, prompt, images=images, sampling=params)
            started[rid], sent = time.perf_counter(), sent + 1
        if not engine.has_unfinished():
            time.sleep(min(0.002, max(arrivals[sent] - (time.perf_counter() - t0), 0)))
            continue
        for o in engine.step():
            stamp = time.perf_counter()
            first.setdefault(o.request_id, stamp)
            last[o.request_id] = stamp
            count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    end = time.perf_counter()
    ttft = sorted(first[r] - started[r] for r in started)
    tpot = sorted((last[r] - first[r]) / max(count[r] - 1, 1) for r in started)
    return {"requests": len(requests), "image_requests": sum(1 for _, ims in requests if ims), "rate": rate,
            "new_tokens": new_tokens, "wall_s": end - t0, "requests_per_s": len(requests) / (end - t0),
            "output_tokens_per_s": sum(count.values()) / (end - t0),
            "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p99_ms": 1e3 * _pct(ttft, 99),
            "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p99_ms": 1e3 * _pct(tpot, 99)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def memory_snapshot(device: str) -> dict[str, float]:
    """This process's memory: GPU memory on CUDA (allocated now and at peak), resident set on CPU, in MiB."""
    if device.startswith("cuda"):
        return {"gpu_allocated_mib": torch.cuda.memory_allocated() / 2**20,
                "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    return {"rss_mib": rss_mib("self")}


def rss_mib(pid: int | str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
