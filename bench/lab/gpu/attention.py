"""The GPU check's `attention` part (bench/lab/gpu/check.py): what exact-length attention costs on the device, and why.

- `padded_tokens`: the tiny checkpoints' requests with padded attention (`--attention padded`) in bf16,
  against the `exact` part's HF ids: how often one padded SDPA call per group changes a greedy token;
- `serving_padded`: the `big` part's serving run with padded attention;
- `decode_profile`: one decode step of the throughput model at a batch size, exact and padded: the
  step's wall time, and under torch.profiler the operator calls it makes, the device's busy time and
  the operators that take the host's time. A step whose device time is a small part of its wall time
  is bound by the host issuing operators, not by the GPU.
"""

from __future__ import annotations

import time
from typing import Any

from lab.gpu import big as gpu_big


def padded_tokens(reference: dict[str, Any], args) -> dict[str, Any]:
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.sequence import SamplingParams

    builder = PromptBuilder(reference["model"])
    prepared = [builder.prepare_text(text, images) for text, images in reference["requests"]]
    engine = Engine(EngineConfig(str(reference["model"]), device=args.device, dtype="bfloat16", num_blocks=512,
                                 max_num_batched_tokens=4096, exact_attention=False))
    for i, pp in enumerate(prepared):
        engine.add_request(f"r{i}", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=args.new_tokens))
    results = engine.run_until_done()
    from lab.gpu.check import compare

    result = compare([results[f"r{i}"] for i in range(len(prepared))], reference["want"], reference["requests"])
    return {"requests": result["requests"], "equal": result["equal"],
            "first_diffs": [m["first_diff"] for m in result["mismatches"]]}


def decode_profile(engine, prompts: list[list[int]], device: str, steps: int = 8, profiled: int = 3) -> dict[str, Any]:
    """Wall ms per decode step (mean of `steps`), then `profiled` steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from mserve.workers.sequence import SamplingParams

    params = SamplingParams(max_tokens=steps + profiled + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{len(prompts)}-{i}-{time.perf_counter()}", p, sampling=params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill: every request has its first token
        started.update(o.request_id for o in engine.step())
    gpu_big._sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    gpu_big._sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            engine.step()
        gpu_big._sync(device)
    while engine.has_unfinished():
        engine.step()
    averages = prof.key_averages()
    aten = [e for e in averages if e.key.startswith("aten::")]

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    top = sorted(aten, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "batch": len(prompts), "step_wall_ms": wall_ms,
        "aten_calls_per_step": sum(e.count for e in aten) / profiled,
        "sdpa_calls_per_step": sum(e.count for e in aten if e.key == "aten::scaled_dot_product_attention") / profiled,
        "device_busy_ms_per_step": sum(device_us(e) for e in averages) / 1e3 / profiled,
        "top_host_ops": [{"op": e.key, "calls_per_step": e.count / profiled,
                          "host_ms_per_step": e.self_cpu_time_total / 1e3 / profiled} for e in top],
    }


def check_attention(references: dict[str, Any], work, args) -> dict[str, Any]:
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig

    out: dict[str, Any] = {"padded_tokens": {}}
    for arch, reference in references.items():
        out["padded_tokens"][arch] = padded_tokens(reference, args)
    size = args.big or ("7b" if args.device.startswith("cuda") else "tiny")
    model_dir, model = gpu_big.build_big_llava(work / f"llava-{size}-attention", size, args.device)
    batches = [int(b) for b in args.profile_batches.split(",") if b]
    need = max(batches) * (args.prompt_tokens + 64) + args.serve_requests * 1200
    engine = Engine(EngineConfig(str(model_dir), device=args.device, dtype="bfloat16", num_blocks=need // 16 + 64,
                                 max_num_seqs=max(64, max(batches)), max_num_batched_tokens=8192,
                                 enable_prefix_caching=False), model=model)
    builder = PromptBuilder(model_dir)
    prompts = gpu_big.text_prompts(max(batches), args.prompt_tokens, builder.tokenizer, engine.family.image_token_id)
    gpu_big.engine_batch(engine, prompts[:2], 4, args.device)  # warm-up
    out["profile"] = []
    for b in batches:
        for exact in (True, False):
            engine.runner.exact_attention = exact
            out["profile"].append({"attention": "exact" if exact else "padded",
                                   **decode_profile(engine, prompts[:b], args.device)})
    # The `big` part's serving run (exact there), padded: what a user choosing speed gets.
    engine.runner.exact_attention = False
    from lab.gpu.check import TEXTS

    serve = gpu_big.serving_requests(args.serve_requests, args.prompt_tokens // 2, builder, engine.family.image_token_id,
                                     TEXTS)
    out["serving_padded"] = gpu_big.serving_run(engine, serve, args.serve_rate, args.bench_new_tokens // 2)
    engine.runner.exact_attention = True
    return out
