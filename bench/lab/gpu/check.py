"""The prepared device check of issue 24, in one run (bench/gpu_check.md says how to start it on the GPU machine;
bench/gpu_check.py is the launcher it names):

1. `exact`: bf16 exactness of the engine against HF `generate` in bf16, on the device, for tiny
   LLaVA and Qwen2-VL checkpoints (a ragged batch decoded together);
2. `cluster`: a 1e1p1d cluster on the one device (three worker processes) with each transfer backend
   named in --transfers (default torch: CUDA IPC between processes on one GPU, NCCL across GPUs,
   gloo on CPU), tokens against the same HF run;
3. `big`: a 7B-class random-weight LLaVA built on the device (bench/lab/gpu/big.py): engine throughput at
   --batches beside HF's own batched generate on the same weights, a short serving run, memory per role;
4. `attention` (not run by default): padded attention's tokens against HF's, and a profile of a decode
   step exact and padded (bench/lab/gpu/attention.py).

It writes gpu_check.json and gpu_check.md under --out (default $OUT) after every part, so a run cut
short keeps what it measured. A part that fails is recorded with its error and the rest still run.

    python3 bench/gpu_check.py --device cuda --out $OUT
    python3 bench/gpu_check.py --device cpu --big tiny --requests 3 --out /tmp/gc    # dry run
    (or, from bench/: python -m lab.gpu.check ...)
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import logging
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from lab.gpu import big as gpu_big
from lab.gpu.report import render

log = logging.getLogger("lab.gpu.check")
PARTS = ("exact", "cluster", "big", "attention")
DEFAULT_PARTS = ("exact", "cluster", "big")
FAMILIES = ("llava", "qwen2_vl")
TEXTS = ("Describe the picture.", "What is in this image? Answer in one short sentence please.",
         "List three colours you can see.", "Hi", "Tell me a story about a small robot who learns to paint.",
         "Compare the two halves of the image.", "Is this a photograph or a drawing?", "Count the objects.",
         "Write a haiku about it.")
SIZES = ((224, 224), (336, 252), (200, 150), (640, 480), (120, 90), (300, 400))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run); default cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/gpu_check",
                   help="folder for gpu_check.json and gpu_check.md (default $OUT)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"which of {','.join(PARTS)}, comma-separated (default {','.join(DEFAULT_PARTS)}); attention: "
                        "what exact-length attention costs (bench/lab/gpu/attention.py)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"tiny checkpoints checked (default {','.join(FAMILIES)})")
    p.add_argument("--requests", type=int, default=9, help="requests per family for exact and cluster (default 9)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per exactness request (default 16)")
    p.add_argument("--transfers", default="torch", help="cluster transfer backends, comma-separated (default torch)")
    p.add_argument("--cluster-timeout", type=float, default=75.0,
                   help="seconds for a cluster's requests to be answered (default 75; a cluster start has its own 120)")
    p.add_argument("--big", default=None, choices=sorted(gpu_big.BIG_SIZES),
                   help="size of the throughput model: 7b (default on cuda) or tiny (default on cpu)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="mean text prompt length for throughput (default 128)")
    p.add_argument("--bench-new-tokens", type=int, default=64, help="tokens per request for throughput (default 64)")
    p.add_argument("--serve-requests", type=int, default=48, help="requests in the serving run (default 48)")
    p.add_argument("--serve-rate", type=float, default=8.0, help="their Poisson rate, req/s (default 8)")
    p.add_argument("--profile-batches", default="8,32", help="attention part: decode batch sizes profiled (default 8,32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: torch's)")
    return p


def sample_requests(n: int, seed: int = 0) -> list[tuple[str, list[bytes]]]:
    """n (text, images) pairs cycling text-only, one image and two images, of varied sizes, all distinct."""
    import numpy as np

    from mserve.bench.images import ImageFactory

    images = ImageFactory(np.random.default_rng(seed), use_photos=False, distinct=True)
    return [(TEXTS[i % len(TEXTS)], [images.make(SIZES[(i + j) % len(SIZES)]) for j in range(i % 3)]) for i in range(n)]


def hf_reference(model_dir: Path, prepared: list, new_tokens: int, device: str) -> list[list[int]]:
    """HF generate's greedy ids in bf16 on `device`, one request at a time, with the pixel values of
    the very processor the engine uses (mserve.common.model's family processor)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from mserve.common.model import load_family

    family = load_family(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    out = []
    for pp in prepared:
        ids = torch.tensor([list(pp.prompt_ids)], device=device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if pp.images:
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in pp.images]
            inputs = family.processor.image_processor(images=pil, return_tensors="pt")
            kwargs.update({k: v.to(device) for k, v in inputs.items() if torch.is_tensor(v)})
        if family.uses_mrope:
            kwargs["mm_token_type_ids"] = (ids == family.image_token_id).int()
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.do_sample = new_tokens, False
        with torch.inference_mode():
            out.append(model.generate(**kwargs, generation_config=config)[0, ids.shape[1]:].tolist())
    del model
    _free(device)
    return out


def compare(got: list[list[int]], want: list[list[int]], requests) -> dict[str, Any]:
    mismatches = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            mismatches.append({"request": i, "images": len(requests[i][1]), "first_diff": first, "got": g, "hf": w})
    return {"requests": len(want), "equal": len(want) - len(mismatches), "mismatches": mismatches}


def check_exact(arch: str, work: Path, args) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the family's result, what the cluster part reuses: checkpoint, requests, HF's ids)."""
    from mserve.common.prompt import PromptBuilder
    from mserve.common.tiny_model import make_tiny_model
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.sequence import SamplingParams

    model_dir = make_tiny_model(work / arch, arch, "tiny", seed=0)
    requests = sample_requests(args.requests)
    builder = PromptBuilder(model_dir)
    prepared = [builder.prepare_text(text, images) for text, images in requests]
    engine = Engine(EngineConfig(str(model_dir), device=args.device, dtype="bfloat16", num_blocks=512,
                                 max_num_batched_tokens=4096))
    for i, pp in enumerate(prepared):
        engine.add_request(f"r{i}", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=args.new_tokens))
    t0 = time.perf_counter()
    results = engine.run_until_done()
    engine_s = time.perf_counter() - t0
    kv_dtype = str(engine.runner.kv.dtype)
    del engine
    _free(args.device)
    want = hf_reference(model_dir, prepared, args.new_tokens, args.device)
    result = {**compare([results[f"r{i}"] for i in range(len(prepared))], want, requests),
              "prompt_tokens": [len(pp.prompt_ids) for pp in prepared], "kv_dtype": kv_dtype, "engine_s": engine_s}
    return result, {"model": model_dir, "requests": requests, "want": want}


def check_cluster(reference: dict[str, Any], transfer: str, args) -> dict[str, Any]:
    """A 1e1p1d cluster in bf16 on this device with `transfer`; every worker's memory after the run."""
    import asyncio

    from mserve.coordinator.client import AsyncClient
    from mserve.coordinator.launcher import LocalCluster

    requests, want = reference["requests"], reference["want"]
    worker_args = ["--device", args.device, "--dtype", "bfloat16"]
    t0 = time.perf_counter()
    with LocalCluster(str(reference["model"]), encode=1, prefill=1, decode=1, transfer=transfer,
                      extra_worker_args=worker_args) as cluster:
        started_s = time.perf_counter() - t0

        async def run() -> list:
            async with AsyncClient(cluster.address, timeout_s=args.cluster_timeout) as client:
                return await asyncio.gather(*[client.generate(_chat(text, images), max_tokens=args.new_tokens)
                                              for text, images in requests])

        try:
            results = asyncio.run(asyncio.wait_for(run(), args.cluster_timeout))
        except BaseException as exc:
            tails = {name: cluster.log_tail(name, 15) for name in cluster.processes}
            return {"transfer": transfer, "error": f"{exc.__class__.__name__}: {exc}", "log_tails": tails}
        memory = {name: {"rss_mib": gpu_big.rss_mib(proc.pid)} for name, proc in cluster.processes.items()}
        # Which receivers copied through CUDA IPC (a sender on their own GPU) rather than NCCL.
        ipc = {name: _log_count(cluster, name, "use CUDA IPC") for name in cluster.processes}
        for pid, mib in _gpu_memory_by_pid().items():
            for name, proc in cluster.processes.items():
                if proc.pid == pid:
                    memory[name]["gpu_mib"] = mib
    return {"transfer": transfer, "start_s": started_s, "memory": memory, "cuda_ipc_senders": ipc,
            **compare([r.token_ids for r in results], want, requests)}


def _log_count(cluster, name: str, text: str) -> int:
    try:
        return cluster.log_path(name).read_text(errors="replace").count(text)
    except (OSError, RuntimeError):
        return -1


def _chat(text: str, images: list[bytes]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]}]


def _gpu_memory_by_pid() -> dict[int, float]:
    """pid -> MiB from nvidia-smi's compute-apps list (empty without nvidia-smi, or where pids don't map)."""
    import subprocess

    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            out[int(parts[0])] = float(parts[1]) if parts[1].replace(".", "").isdigit() else float("nan")
    return out


def check_big(work: Path, args) -> dict[str, Any]:
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig

    size = args.big or ("7b" if args.device.startswith("cuda") else "tiny")
    model_dir, model = gpu_big.build_big_llava(work / f"llava-{size}", size, args.device)
    result: dict[str, Any] = {"size": size, "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
                              **{k: v / 2**20 for k, v in {f"{n}_mib": b for n, b in gpu_big.part_bytes(model).items()}.items()}}
    batches = [int(b) for b in args.batches.split(",")]
    need = max(batches) * (args.prompt_tokens + args.bench_new_tokens) + args.serve_requests * 1200
    engine = Engine(EngineConfig(str(model_dir), device=args.device, dtype="bfloat16", num_blocks=need // 16 + 64,
                                 max_num_seqs=max(64, max(batches)), max_num_batched_tokens=4096,
                                 enable_prefix_caching=False), model=model)
    result["kv_pool_mib"] = engine.runner.kv.bytes_per_block * engine.runner.kv.num_blocks / 2**20
    builder = PromptBuilder(model_dir)
    prompts = gpu_big.text_prompts(max(batches), args.prompt_tokens, builder.tokenizer, engine.family.image_token_id)
    gpu_big.engine_batch(engine, prompts[:2], 4, args.device)  # warm-up
    result["engine"] = {b: gpu_big.engine_batch(engine, prompts[:b], args.bench_new_tokens, args.device) for b in batches}
    engine.runner.exact_attention = False  # the same engine, one padded SDPA call per group: what exactness costs
    result["engine_padded"] = {b: gpu_big.engine_batch(engine, prompts[:b], args.bench_new_tokens, args.device)
                               for b in batches}
    engine.runner.exact_attention = True
    result["memory_after_engine"] = gpu_big.memory_snapshot(args.device)
    pad = engine.runner.model.generation_config.pad_token_id or 0
    gpu_big.hf_batch(model, prompts[:2], 2, args.device, pad)  # warm-up
    result["hf_generate"] = {b: gpu_big.hf_batch(model, prompts[:b], args.bench_new_tokens, args.device, pad)
                             for b in batches}
    serve = gpu_big.serving_requests(args.serve_requests, args.prompt_tokens // 2, builder, engine.family.image_token_id,
                                     TEXTS)
    result["serving"] = gpu_big.serving_run(engine, serve, args.serve_rate, args.bench_new_tokens // 2)
    result["memory_after_serving"] = gpu_big.memory_snapshot(args.device)
    del engine, model
    _free(args.device)
    return result


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return env


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"error: unknown part(s) {unknown}; --parts takes {','.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": _environment(args.device), "exact": {}, "cluster": {}, "timings_s": {}}
    work = Path(tempfile.mkdtemp(prefix="mserve-gpu-check-"))
    references: dict[str, Any] = {}

    def record(key: str, name: str, fn) -> Any:
        t0 = time.perf_counter()
        log.info("%s %s ...", key, name)
        try:
            value = fn()
        except Exception as exc:
            value = {"error": f"{exc.__class__.__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        report["timings_s"][f"{key}:{name}"] = time.perf_counter() - t0
        _write(out, report)
        return value

    if "exact" in parts or "cluster" in parts or "attention" in parts:
        for arch in [a for a in args.families.split(",") if a]:
            value = record("exact", arch, lambda arch=arch: check_exact(arch, work, args))
            if isinstance(value, tuple):
                report["exact"][arch], references[arch] = value
            else:
                report["exact"][arch] = value
            _write(out, report)
    if "cluster" in parts:
        for transfer in [t for t in args.transfers.split(",") if t]:
            for arch in references:
                report["cluster"][f"{arch}-{transfer}"] = record(
                    "cluster", f"{arch}-{transfer}", lambda: check_cluster(references[arch], transfer, args))
                _write(out, report)
    if "big" in parts:
        report["big"] = record("big", args.big or "", lambda: check_big(work, args))
    if "attention" in parts:
        from lab.gpu.attention import check_attention

        report["attention"] = record("attention", "", lambda: check_attention(references, work, args))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(out, report)
    print(render(report))
    return 0


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(render(report))


if __name__ == "__main__":
    raise SystemExit(main())
