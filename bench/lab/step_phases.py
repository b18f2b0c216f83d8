"""Where one engine decode step's wall time goes, phase by phase (issue 20, item 1).

`python -m lab.step_phases --model /tmp/small-llava-c --batches 1,8,16` prefills a batch of text
prompts, then times pure decode steps of the whole batch. Every phase is a wall clock around the
calls that do it (torch.profiler inflates many-small-op code several times over, so it misleads
here); nested phases are reported net of what they contain:

- schedule / postprocess: the scheduler's two calls; sample: workers/sampler.sample;
- input prep: ModelRunner._inputs less the embedding lookup; embedding: the `embed_tokens` call;
  batch build: PagedBatch.build (slots, block tables, masks);
- per layer, summed over layers: attention projections + RoPE (the self_attn module less the
  paged function), KV write (the paged function less _attend: two index_copy_ into the pool),
  KV gather (_gather), SDPA, or instead of both the decode kernel that reads the pool in place
  (workers/paged_decode.py; `MSERVE_DECODE_KERNEL=off` for the gather), the rest of _attend
  (reshapes), the MLP, the two RMSNorms;
- final norm, LM head, and "between ops": the step's wall time less every phase above (the HF
  decoder loop, the engine's own Python, the timers themselves).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any, Callable, Iterator

PHASES = ("schedule", "input_prep", "embedding", "batch_build", "attn_proj_rope", "kv_write", "kv_gather",
          "sdpa", "decode_kernel", "attend_rest", "mlp", "norms", "final_norm", "lm_head", "sample", "postprocess", "between_ops")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder (e.g. a `small` tiny llava)")
    p.add_argument("--batches", default="1,8,16", help="batch sizes, comma-separated (default 1,8,16)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens per request (default 100)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per repeat (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per batch size; medians reported (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--dtype", default=None, help="model dtype (bfloat16, float32; default: the checkpoint's)")
    p.add_argument("--attention", choices=("exact", "padded", "auto"), default="auto",
                   help="exact: HF's bits; padded: the fast kernels (bf16); auto: the engine's default")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")


class _Clock:
    """Accumulates wall time per phase, and the time of phases nested inside each one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.stack: list[list[float]] = []  # per open phase: [time spent in phases nested in it]

    def wrap(self, name: str, inner: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                nested = self.stack.pop()[0]
                self.total[name] = self.total.get(name, 0.0) + dt - nested  # net of nested phases
                if self.stack:
                    self.stack[-1][0] += dt
        return timed


@contextlib.contextmanager
def timed_phases(engine: Any, clock: _Clock) -> Iterator[None]:
    import torch.nn.functional as F
    from transformers import AttentionInterface

    from mserve.workers import engine as engine_mod
    from mserve.workers import paged_attention as pa
    from mserve.workers import paged_decode

    runner = engine.runner
    lm = runner.language_model
    restore: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)
        restore.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else inner))
        setattr(owner, attr, clock.wrap(phase, inner))

    patch(engine.scheduler, "schedule", "schedule")
    patch(engine.scheduler, "postprocess", "postprocess")
    patch(engine_mod, "sample", "sample")
    patch(runner, "_inputs", "input_prep")
    patch(runner.embed_tokens, "forward", "embedding")
    patch(pa.PagedBatch, "build", "batch_build")
    patch(pa, "_gather", "kv_gather")
    patch(F, "scaled_dot_product_attention", "sdpa")
    patch(paged_decode, "attend", "decode_kernel")
    patch(pa, "_attend", "attend_rest")
    for layer in lm.layers:
        patch(layer.self_attn, "forward", "attn_proj_rope")
        patch(layer.mlp, "forward", "mlp")
        patch(layer.input_layernorm, "forward", "norms")
        patch(layer.post_attention_layernorm, "forward", "norms")
    patch(lm.norm, "forward", "final_norm")
    patch(runner.model.lm_head, "forward", "lm_head")
    # The registered attention function is looked up by name at each call: register a timed one.
    AttentionInterface.register(pa.ATTN_IMPLEMENTATION, clock.wrap("kv_write", pa.paged_attention_forward))
    try:
        yield
    finally:
        AttentionInterface.register(pa.ATTN_IMPLEMENTATION, pa.paged_attention_forward)
        for owner, attr, inner in reversed(restore):
            if isinstance(owner, type) or owner in (pa, F, engine_mod, paged_decode):
                setattr(owner, attr, inner)
            else:  # an instance: drop the shadowing attribute, the class's method shows again
                delattr(owner, attr)


def decode_batch(model: str, batch: int, context: int, steps: int, dtype: str | None = None,
                 attention: str = "auto") -> Any:
    """An engine whose `batch` requests are all prefilled: every later step is a pure decode step."""
    import torch

    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.sequence import SamplingParams

    engine = Engine(EngineConfig(model, num_blocks=batch * (context + 4 * steps + 64) // 16 + 64, block_size=16,
                                 max_num_seqs=batch, max_num_batched_tokens=8192, enable_prefix_caching=False,
                                 dtype=dtype, exact_attention={"exact": True, "padded": False}.get(attention)))
    vocab = engine.runner.model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4 * steps + 32, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(10, min(vocab, 1000), (context,), generator=g).tolist(),
                           sampling=params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()  # warm-up
    return engine


def measure(model: str, batch: int, context: int, steps: int, repeats: int, dtype: str | None = None,
            attention: str = "auto") -> dict[str, Any]:
    engine = decode_batch(model, batch, context, steps, dtype, attention)
    runs = []
    for _ in range(repeats):
        clock = _Clock()
        t0 = time.perf_counter()
        with timed_phases(engine, clock):
            for _ in range(steps):
                engine.step()
        wall = time.perf_counter() - t0
        part = {k: 1000 * clock.total.get(k, 0.0) / steps for k in PHASES if k != "between_ops"}
        step_ms = 1000 * wall / steps
        runs.append({"step_ms": step_ms, **part, "between_ops": step_ms - sum(part.values())})
    # Untimed steps too: what the timers themselves add.
    plain = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        plain.append(1000 * (time.perf_counter() - t0) / steps)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"batch": batch, "context": context, "steps": steps, "repeats": repeats,
            "untimed_step_ms": statistics.median(plain), **med}


def render(rows: list[dict[str, Any]]) -> str:
    head = "| phase (ms per step) | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]
    for k in ("untimed_step_ms", "step_ms") + PHASES:
        cells = []
        for r in rows:
            share = "" if k.endswith("step_ms") else f" ({100 * r[k] / r['step_ms']:.0f} %)"
            cells.append(f"{r[k]:.2f}{share}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m lab.step_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(args.model, int(b), args.context, args.steps, args.repeats, args.dtype, args.attention)
            for b in args.batches.split(",")]
    print(render(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
