"""What one engine decode step costs beside its own matmuls (issue 7 item 5), and the floor on this host.

`python -m lab.decode_step --model models/small-llava` prefills a batch of text prompts,
then times decode steps of the whole batch. Parts are timed by wall clock around the calls that do
them (torch.profiler inflates many-small-op indexing several times over, so it misleads here):

- matmuls: every `nn.Linear` (the checkpoint's projections and the LM head);
- paged attention: the registered attention function, split into the KV gather and SDPA;
- the rest: HF module ops (norms, rotary, activations) and the engine's own Python.

It also measures this host's memory bandwidth, and from it the floor of the attention's memory
traffic: the gather reads and writes every context block once and SDPA reads it again (3 passes),
where a fused paged kernel would read it once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from typing import Any, Iterator

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder (a `small` tiny model)")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together (default 32)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens per request (default 100)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed (default 40)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")


@contextlib.contextmanager
def _timed_parts(acc: dict[str, float]) -> Iterator[None]:
    """Add the wall time of each part's calls to `acc` while inside."""
    import torch.nn.functional as F
    from torch import nn

    from mserve.workers import paged_attention as pa

    def wrap(owner: Any, name: str, key: str) -> tuple[Any, str, Any]:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t0

        setattr(owner, name, timed)
        return owner, name, inner

    saved = [wrap(nn.Linear, "forward", "matmul"), wrap(pa, "_gather", "gather"),
             wrap(F, "scaled_dot_product_attention", "sdpa"), wrap(pa, "_attend", "attention")]
    try:
        yield
    finally:
        for owner, name, inner in saved:
            setattr(owner, name, inner)


def memory_bandwidth_gbs(mib: int = 256, iters: int = 8) -> float:
    """Read + write GB/s of one large tensor copy (well past the caches)."""
    import torch

    a = torch.ones(mib * 1024 * 1024 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def measure(model: str, batch: int, context: int, steps: int, threads: int = 1) -> dict[str, Any]:
    import torch

    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.sequence import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model, num_blocks=batch * (context + steps + 40) // 16 + 64, block_size=16,
                                 max_num_seqs=batch, max_num_batched_tokens=8192, enable_prefix_caching=False))
    vocab = engine.runner.model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(10, min(vocab, 1000), (context,), generator=g).tolist(),
                           sampling=params)
    started: set[str] = set()
    while len(started) < batch:  # prefill every prompt; the steps below are pure decode steps of the whole batch
        started.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()  # warm-up
    acc = dict.fromkeys(("matmul", "attention", "gather", "sdpa"), 0.0)
    walls = []
    with _timed_parts(acc):
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            walls.append(time.perf_counter() - t0)
            assert len(outs) == batch, f"a decode step gave {len(outs)} tokens for {batch} requests"
    kv = engine.runner.kv
    ctx = context + 3 + steps // 2  # mean context over the timed steps
    kv_bytes = batch * -(-ctx // kv.block_size) * kv.bytes_per_block  # every context block, K and V, all layers
    bw = memory_bandwidth_gbs()
    step_ms = 1000 * statistics.mean(walls)
    part = {k: 1000 * v / steps for k, v in acc.items()}
    return {
        "model": model, "batch": batch, "context": context, "threads": threads, "steps": steps,
        "step_ms": step_ms, "step_ms_p50": 1000 * statistics.median(walls),
        **{f"{k}_ms": v for k, v in part.items()},
        "other_ms": step_ms - part["matmul"] - part["attention"],
        "step_over_matmul": step_ms / part["matmul"],
        "kv_mib_per_step": kv_bytes / 2**20, "memory_gbs": bw,
        # The attention's memory floor: 3 passes over the context's KV (gather read + write, SDPA read)
        # as done here, 1 pass for a fused paged kernel.
        "gather_sdpa_floor_ms": 3 * kv_bytes / bw / 1e6, "fused_floor_ms": kv_bytes / bw / 1e6,
    }


def render(r: dict[str, Any]) -> str:
    mm = r["matmul_ms"]
    return "\n".join([
        f"decode step, batch {r['batch']}, {r['context']}-token prompts, {r['threads']} thread(s), {r['model']}",
        f"  step {r['step_ms']:.1f} ms (p50 {r['step_ms_p50']:.1f}) = {r['step_over_matmul']:.2f}x its matmuls",
        f"  matmuls {mm:.1f} ms | paged attention {r['attention_ms']:.1f} ms (KV gather {r['gather_ms']:.1f}, "
        f"SDPA {r['sdpa_ms']:.1f}) | rest {r['other_ms']:.1f} ms",
        f"  KV read per step {r['kv_mib_per_step']:.0f} MiB at {r['memory_gbs']:.1f} GB/s: attention floor "
        f"{r['gather_sdpa_floor_ms']:.1f} ms gathered (3 passes), {r['fused_floor_ms']:.1f} ms fused (1 pass)",
        f"  best case with a gather: {(mm + r['gather_sdpa_floor_ms'] + r['other_ms']) / mm:.2f}x; "
        f"with a fused kernel: {(mm + r['fused_floor_ms'] + r['other_ms']) / mm:.2f}x",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    r = measure(args.model, args.batch, args.context, args.steps, args.threads)
    print(render(r))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
