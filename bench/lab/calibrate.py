"""Per-stage costs of this machine, measured with the real engine and transfer code, for the scale model.

Usage: python -m lab.calibrate --model models/small-llava --out bench/lab/costs/cpu-small-llava.json
       [--threads 1] [--skip-transfer] [--skip-coordinator] [--cores 2]

What is measured (every figure a median of repeated runs, one torch thread as the workers run;
engine figures in CPU seconds of the process, so other tenants of a shared host do not count):

* encode: ``Engine.decode_visual`` + ``ModelRunner.encode_visuals`` on the trace's own synthetic
  images at every trace resolution (batch 1), and batches of 1/4/8 images at one size; fitted as
  ``batch_s + k * (image_s + per_mpx_s * megapixels)`` (LLaVA: a fixed 576 patches per image, so
  "per patch" is ``image_s / 576``).
* prefill: one engine step over prompts of 32..512 tokens (one or several sequences) with
  ``prefill_only``; fitted as ``step_s + per_token_s * tokens + per_seq_s * seqs``, checked
  against a whole image prompt (two chunks of at most 512 tokens).
* decode: engine steps over batches of 1..32 requests adopted through ``import_kv`` at contexts
  of ~100 and ~700 tokens; fitted as ``step_s + per_seq_s * batch + per_ctx_token_s * sum(ctx)``.
* transfer: ``lab.transfer_bench_procs`` (two processes, the real TransferEngine) at
  9.5 MiB and 64 MiB; fitted as ``fixed_s + per_byte_s * bytes`` per path.
* coordinator: ``lab.coord_calibrate`` (the real coordinator process, fake workers).
* prompt sizes: the trace's prompts through the checkpoint's own chat template and tokenizer.

The cost file is what ``python -m lab.simulate --costs FILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger("lab.calibrate")


# The engine figures are CPU seconds of this (single-threaded) process, not wall time: on a shared,
# noisy host a preempted step would otherwise count another tenant's work. The simulator adds the
# sharing back explicitly (its CPU pool). Wall time is kept beside them for reference.
CLOCK = time.process_time
WALL: dict[str, float] = {}


def _median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times, walls = [], []
    for _ in range(reps):
        t0, w0 = CLOCK(), time.perf_counter()
        fn()
        times.append(CLOCK() - t0)
        walls.append(time.perf_counter() - w0)
    WALL["cpu_s"] = WALL.get("cpu_s", 0.0) + sum(times)
    WALL["wall_s"] = WALL.get("wall_s", 0.0) + sum(walls)
    return statistics.median(times)


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares; a coefficient that comes out negative (noise) is dropped (set to 0) and the rest refitted."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef):
                out[i] = float(c)
            return out
        keep.pop(int(np.argmin(coef)))


def measure_prompts(builder: Any) -> dict[str, float]:
    """Prompt tokens of the trace's requests: text-only and one-image, at 64 words (the trace default)."""
    from mserve.bench.traces import make_trace

    out: dict[str, float] = {}
    for name in ("text", "image"):
        trace = make_trace(name, 6, seed=0, photos=False, prompt_tokens=64)
        counts = [len(builder.prepare(r.messages).prompt_ids) for r in trace]
        out[f"{name}_prompt_tokens"] = float(statistics.mean(counts))
    per_word = []
    for words in (16, 128):
        trace = make_trace("text", 4, seed=1, photos=False, prompt_tokens=words)
        per_word.append(statistics.mean(len(builder.prepare(r.messages).prompt_ids) for r in trace))
    slope = (per_word[1] - per_word[0]) / (128 - 16)
    out["tokens_per_word"] = slope
    out["template_tokens"] = per_word[0] - 16 * slope
    out["visual_tokens_per_image"] = out["image_prompt_tokens"] - out["text_prompt_tokens"]
    return out


def measure_encode(engine: Any, reps: int) -> dict[str, Any]:
    from mserve.bench.images import IMAGE_RESOLUTIONS, ImageFactory

    factory = ImageFactory(np.random.default_rng(0), use_photos=False, distinct=True)
    single: dict[str, float] = {}
    rows, ys = [], []
    for (w, h), _ in IMAGE_RESOLUTIONS:
        data = factory.make((w, h))
        t = _median_time(lambda: engine.runner.encode_visuals([engine.decode_visual(data)]), reps)
        single[f"{w}x{h}"] = t
        rows.append([1.0, w * h / 1e6])
        ys.append(t)
    per_image_s, per_mpx_s = _lstsq(rows, ys)
    data = factory.make((640, 480))
    batches = {}
    for k in (1, 4, 8):
        pil = [engine.decode_visual(data) for _ in range(k)]
        batches[k] = _median_time(lambda: engine.runner.encode_visuals(pil), reps)
    # Marginal vision-forward cost per image from the batch sizes; the rest of batch 1 is per-batch.
    fwd_image_s = (batches[8] - batches[1]) / 7
    batch_s = max(0.0, batches[1] - fwd_image_s)
    image_s = max(0.0, per_image_s - batch_s)
    return {"batch_s": batch_s, "image_s": image_s, "per_mpx_s": max(0.0, per_mpx_s),
            "measured_single_s": single, "measured_batch_640x480_s": batches}


def _text_ids(builder: Any, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    specials = set(builder.tokenizer.all_special_ids) | {builder.family.image_token_id}
    pool = [t for t in range(len(builder.tokenizer)) if t not in specials]
    return [int(x) for x in rng.choice(pool, size=n)]


def measure_prefill(engine: Any, builder: Any, reps: int) -> dict[str, Any]:
    from mserve.workers.sequence import SamplingParams

    counter = [0]

    def one_step(lengths: list[int]) -> None:
        ids = []
        for n in lengths:
            counter[0] += 1
            rid = f"p{counter[0]}"
            ids.append(rid)
            engine.add_request(rid, _text_ids(builder, n, counter[0]), encoded=[], prefill_only=True,
                               sampling=SamplingParams(max_tokens=1))
        engine.step()
        for rid in ids:
            engine.abort(rid)

    rows, ys, measured = [], [], {}
    for lengths in ([32], [128], [256], [512], [64] * 4, [128] * 4, [32] * 8):
        t = _median_time(lambda: one_step(lengths), reps)
        measured["+".join(map(str, lengths))] = t
        rows.append([1.0, float(sum(lengths)), float(len(lengths))])
        ys.append(t)
    step_s, per_token_s, per_seq_s = _lstsq(rows, ys)

    # A whole image prompt (chunks of at most max_prefill_tokens), encoded outside the timing.
    from mserve.bench.images import ImageFactory

    image = ImageFactory(np.random.default_rng(1), use_photos=False, distinct=True).make((640, 480))
    prepared = builder.prepare_text(pseudo_text(64), [image])
    encoded = engine.encode([image])

    def image_prompt() -> None:
        counter[0] += 1
        rid = f"i{counter[0]}"
        engine.add_request(rid, prepared.prompt_ids, encoded=encoded, image_hashes=[rid], prefill_only=True,
                           sampling=SamplingParams(max_tokens=1))
        engine.run_until_done()
        engine.abort(rid)

    whole = _median_time(image_prompt, reps)
    cap = engine.config.max_prefill_tokens or engine.config.max_num_batched_tokens
    n = len(prepared.prompt_ids)
    chunks = [min(cap, n - i) for i in range(0, n, cap)]
    predicted = sum(step_s + per_token_s * c + per_seq_s for c in chunks)
    # What an image prompt costs beyond its length (placeholder runs, embedding scatter, longer
    # attention, block hashing with image keys), charged per visual token.
    visual = sum(1 for t in prepared.prompt_ids if t == builder.family.image_token_id)
    return {"step_s": step_s, "per_token_s": per_token_s, "per_seq_s": per_seq_s, "chunk_tokens": cap,
            "per_visual_token_s": max(0.0, (whole - predicted) / visual) if visual else 0.0,
            "measured_steps_s": measured,
            "check_image_prompt": {"tokens": n, "visual_tokens": visual, "measured_s": whole, "fitted_s": predicted}}


def pseudo_text(words: int) -> str:
    from mserve.bench.traces import pseudo_english

    return pseudo_english(np.random.default_rng(7), words)


def measure_decode(engine: Any, builder: Any, steps: int) -> dict[str, Any]:
    import torch

    from mserve.common.protocol.client import Sampling
    from mserve.common.protocol.to_worker import KVState
    from mserve.workers.hand_back import KVExport

    kv = engine.runner.kv
    sampling = Sampling(max_tokens=100000, ignore_eos=True)
    rows, ys, table = [], [], {}
    n = 0
    for ctx in (100, 700):
        n_blocks = -(-ctx // engine.pool.block_size)
        kv_tensor = torch.randn(kv.export_shape(n_blocks), dtype=kv.dtype)
        table[ctx] = {}
        for b in (1, 2, 4, 8, 16, 24, 32):
            rids = []
            for _ in range(b):
                n += 1
                rid = f"d{n}"
                rids.append(rid)
                state = KVState(request_id=rid, prompt_ids=_text_ids(builder, ctx, n), output_ids=[],
                                num_computed_tokens=ctx - 1, block_size=engine.pool.block_size, images=[],
                                sampling=sampling)
                engine.import_kv(KVExport(state, kv_tensor), request_id=rid)
            t = _median_time(engine.step, steps, warmup=2)
            for rid in rids:
                engine.abort(rid)
            table[ctx][b] = t
            rows.append([1.0, float(b), float(b * ctx)])
            ys.append(t)
    step_s, per_seq_s, per_ctx_token_s = _lstsq(rows, ys)
    return {"step_s": step_s, "per_seq_s": per_seq_s, "per_ctx_token_s": per_ctx_token_s,
            "measured_step_s": {f"ctx{c}": {str(b): v for b, v in t.items()} for c, t in table.items()}}


def measure_transfer(threads: int, iters: int) -> dict[str, Any]:
    """The real transfer engine between two processes (transfer_bench_procs), fitted per path."""
    import multiprocessing as mp

    from lab import transfer_bench_procs as procs

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    tx_rx, rx_tx = ctx.Pipe()
    workers = [ctx.Process(target=procs.sender, args=(child, tx_rx, 1, iters, 2, threads)),
               ctx.Process(target=procs.receiver, args=(rx_tx, threads))]
    res = procs.run_pair(workers, parent, "transfer calibration")
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    sizes = {k: procs.nbytes(s) for k, s in procs.SIZES.items()}
    out: dict[str, Any] = {}
    for name, path in (("shm", "(a) shm, fetch_view (zero-copy)"), ("shm_copy", "(a) shm, fetch (copy=True)"),
                       ("tcp", "(a) tcp, fetch (copy=True)")):
        small, big = med[("kv", path)], med[("big", path)]
        per_byte = (big - small) / (sizes["big"] - sizes["kv"])
        out[name] = {"fixed_s": max(0.0, small - per_byte * sizes["kv"]), "per_byte_s": per_byte,
                     "measured_s": {"9.5MiB": small, "64MiB": big}}
    # One request's KV hand-off, pool to pool (export in place, transfer, import), per byte of KV.
    kv_bytes = sizes["kv"]
    out["kv_handoff"] = {
        "shm_per_byte_s": med[("pool", "shm: alloc + export in place, fetch_view")] / kv_bytes,
        "tcp_per_byte_s": med[("pool", "tcp: export, publish, fetch")] / kv_bytes,
        "measured_s": {k[1]: v for k, v in med.items() if k[0] == "pool"}, "bytes": kv_bytes}
    return out


def model_sizes(engine: Any) -> dict[str, float]:
    kv = engine.runner.kv
    cfg = engine.runner.model.config
    hidden = cfg.text_config.hidden_size if hasattr(cfg, "text_config") else cfg.hidden_size
    return {"kv_bytes_per_token": kv.bytes_per_block / engine.pool.block_size,
            "embedding_bytes_per_visual_token": hidden * kv.dtype.itemsize if hasattr(kv.dtype, "itemsize") else hidden * 4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="cost file to write (JSON)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1),
                   help="CPU cores the workers share (the simulator's CPU pool; default: this host's)")
    p.add_argument("--skip-transfer", action="store_true")
    p.add_argument("--skip-coordinator", action="store_true")
    p.add_argument("--transfer-iters", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    from mserve.common.perf import tune_malloc
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.settings import WorkerSettings

    tune_malloc()
    torch.set_num_threads(args.threads)
    ws = WorkerSettings(role="unified", model=args.model)  # the workers' own defaults
    engine = Engine(EngineConfig(args.model, num_blocks=ws.num_blocks, block_size=ws.block_size,
                                 max_num_seqs=ws.max_num_seqs, max_num_batched_tokens=ws.max_num_batched_tokens,
                                 max_prefill_tokens=ws.max_prefill_tokens,
                                 enable_prefix_caching=ws.enable_prefix_caching))
    builder = PromptBuilder(args.model)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    costs: dict[str, Any] = {
        "name": f"cpu-{Path(args.model).name}",
        "kind": "measured",
        "source": f"python -m lab.calibrate --model {args.model} ({args.threads} torch thread(s))",
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": {"cores": args.cores, "background_cores": 0.1,
                "note": "workers are single-threaded processes sharing `cores` (processor sharing); background_cores: "
                        "what the rest of the host takes when no cpu.jsonl of the run says (load generator ~0.07 + "
                        "coordinator idle); worker_overhead_cores: per worker, beyond its stage work "
                        "(lab.sim_validate --fit-overhead); contention_factor: lab.cpu_monitor "
                        "--contention"},
        "network": {"hop_s": 1e-4, "backend": "shm"},
    }
    log.info("prompt sizes")
    costs["prompts"] = measure_prompts(builder)
    costs["sizes"] = model_sizes(engine)
    log.info("encode")
    costs["encode"] = {**measure_encode(engine, args.reps), "max_images": ws.max_encode_images}
    log.info("prefill")
    costs["prefill"] = {**measure_prefill(engine, builder, args.reps), "max_num_seqs": ws.max_num_seqs}
    log.info("decode")
    costs["decode"] = {**measure_decode(engine, builder, max(6, 2 * args.reps)), "max_num_seqs": ws.max_num_seqs,
                       "num_blocks": ws.num_blocks, "block_size": ws.block_size, "reserve_tokens": 256}
    load.append(os.getloadavg()[0])
    del engine
    if not args.skip_transfer:
        log.info("transfer")
        costs["transfer"] = measure_transfer(args.threads, args.transfer_iters)
        load.append(os.getloadavg()[0])
    if not args.skip_coordinator:
        from lab.coord_calibrate import measure_coordinator

        log.info("coordinator")
        costs["coordinator"] = measure_coordinator(args.model)
        load.append(os.getloadavg()[0])
    costs["calibration"] = {"wall_s": round(time.perf_counter() - t0, 1),
                            "host_loadavg_1m": [round(x, 2) for x in load],
                            "engine_clock": "process CPU time (time.process_time), 1 torch thread",
                            "engine_cpu_over_wall": round(WALL["cpu_s"] / WALL["wall_s"], 3)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(costs, indent=1) + "\n")
    print(json.dumps({k: costs[k] for k in ("encode", "prefill", "decode")}, indent=1, default=str)[:4000])
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
