"""torch.compile (inductor, CPU) of the language model's forward, against eager, in one run (issue 20, item 2).

`python -m lab.compile_step --model /tmp/small-llava-c` loads one engine and compiles its language
model's forward (registered paged attention included: dynamo traces it, no graph break) with
`--dynamic` (true: symbolic sizes from the first call; none: torch's default, static first then
dynamic on a change). Then, interleaved, eager and compiled alike, several repeats, medians:

- decode: the same batch of prefilled requests stepped `--steps` times per repeat, at each batch size;
- prefill: one request of each `--prefill-tokens` length prefilled alone (max_tokens=1) per repeat.

It reports the compile time each new shape class cost (the first compiled step of each), dynamo's
graph and recompile counts, and, if `--cold-start`, the time from a fresh process to its first
compiled decode step twice: with an empty TORCHINDUCTOR_CACHE_DIR and again with the one it filled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder (e.g. a `small` tiny llava)")
    p.add_argument("--batches", default="1,8,16", help="decode batch sizes, comma-separated (default 1,8,16)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens per decode request (default 100)")
    p.add_argument("--prefill-tokens", default="128,512", help="prefill prompt lengths (default 128,512)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per repeat (default 20)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians (default 5)")
    p.add_argument("--dynamic", choices=("true", "none"), default="true", help="torch.compile dynamic= (default true)")
    p.add_argument("--scope", choices=("model", "layers"), default="model",
                   help="compile the whole language model forward, or each decoder layer (default model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--cold-start", action="store_true", help="also time fresh processes' first compiled step")
    p.add_argument("--cold-start-only", action="store_true", help="only the --cold-start part")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")


class Toggle:
    """The language model's forward, eager or compiled, switched in place on one loaded model.

    scope "model": the whole forward is one graph; "layers": each decoder layer is compiled on its
    own (regional compilation: the layers share one code object, so dynamo traces one layer, not all),
    the paged attention left eager (a graph break): traced, it reads the layer's index, which dynamo
    holds static, and every layer would be a recompile."""

    def __init__(self, language_model: torch.nn.Module, dynamic: bool | None, scope: str = "model") -> None:
        if scope == "layers":
            from transformers import AttentionInterface

            from mserve.workers import paged_attention as pa

            AttentionInterface.register(pa.ATTN_IMPLEMENTATION, torch.compiler.disable(pa.paged_attention_forward))
        self.modules = [language_model] if scope == "model" else list(language_model.layers)
        self.compiled = [torch.compile(m.forward, dynamic=dynamic) for m in self.modules]

    def use(self, compiled: bool) -> None:
        for m, fn in zip(self.modules, self.compiled):
            if compiled:
                m.forward = fn
            elif "forward" in m.__dict__:
                del m.forward


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 1000), (n,), generator=g).tolist()


def _reset(engine: Any) -> None:
    for seq in list(engine.scheduler.waiting + engine.scheduler.running):
        engine.abort(seq.request_id)


def _start_decode(engine: Any, batch: int, context: int, max_tokens: int) -> None:
    from mserve.workers.sequence import SamplingParams

    _reset(engine)
    vocab = engine.runner.model.config.text_config.vocab_size
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", _prompt(vocab, context, i),
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())


def _timed_steps(engine: Any, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1000 * (time.perf_counter() - t0) / steps


def _prefill_ms(engine: Any, n: int, seed: int) -> float:
    from mserve.workers.sequence import SamplingParams

    _reset(engine)
    vocab = engine.runner.model.config.text_config.vocab_size
    engine.add_request(f"p{n}-{seed}-{time.monotonic_ns()}", _prompt(vocab, n, seed),
                       sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    outs = engine.step()
    assert outs and outs[0].finished, "a prefill of max_tokens=1 did not finish in one step"
    return 1000 * (time.perf_counter() - t0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from mserve.workers.engine import Engine, EngineConfig

    batches = [int(b) for b in args.batches.split(",")]
    prefills = [int(n) for n in args.prefill_tokens.split(",")]
    per_req = args.context + (2 * args.repeats + 2) * args.steps + 32
    engine = Engine(EngineConfig(args.model, num_blocks=max(batches) * per_req // 16 + max(prefills) // 16 + 64,
                                 block_size=16, max_num_seqs=max(batches), max_num_batched_tokens=8192,
                                 enable_prefix_caching=False))
    toggle = Toggle(engine.runner.language_model, {"true": True, "none": None}[args.dynamic], args.scope)
    compile_s: dict[str, float] = {}
    out: dict[str, Any] = {"decode": [], "prefill": []}
    for b in batches:
        toggle.use(False)
        _start_decode(engine, b, args.context, per_req - args.context)
        toggle.use(True)
        t0 = time.perf_counter()
        engine.step()  # compiles this shape class (or finds it compiled)
        compile_s[f"decode batch {b}"] = time.perf_counter() - t0
        eager, compiled = [], []
        for _ in range(args.repeats):
            for flag, acc in ((False, eager), (True, compiled)):
                toggle.use(flag)
                acc.append(_timed_steps(engine, args.steps))
        e, c = statistics.median(eager), statistics.median(compiled)
        out["decode"].append({"batch": b, "eager_ms": e, "compiled_ms": c, "speedup": e / c})
    _reset(engine)
    for n in prefills:
        toggle.use(True)
        t0 = time.perf_counter()
        _prefill_ms(engine, n, 0)
        compile_s[f"prefill {n}"] = time.perf_counter() - t0
        eager, compiled = [], []
        for r in range(args.repeats):
            for flag, acc in ((False, eager), (True, compiled)):
                toggle.use(flag)
                acc.append(_prefill_ms(engine, n, r + 1))
        e, c = statistics.median(eager), statistics.median(compiled)
        out["prefill"].append({"tokens": n, "eager_ms": e, "compiled_ms": c, "eager_tok_s": 1000 * n / e,
                               "compiled_tok_s": 1000 * n / c, "speedup": e / c})
    out["first_compiled_step_s"] = compile_s
    out["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    return out


_COLD = """
import sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from lab.compile_step import Toggle, _start_decode
from mserve.workers.engine import Engine, EngineConfig
engine = Engine(EngineConfig({model!r}, num_blocks=256, block_size=16, max_num_seqs=8, enable_prefix_caching=False))
_start_decode(engine, 8, 32, 64)
t1 = time.perf_counter()
toggle = Toggle(engine.runner.language_model, {dynamic}, {scope!r})
toggle.use(True)
engine.step()
t2 = time.perf_counter()
toggle.use(False)  # prefill eager, as the engine's compile option does
_start_decode(engine, 1, 32, 64)
toggle.use(True)
t3 = time.perf_counter()
engine.step()  # a batch of one: dynamo's second graph
t4 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{t4 - t3:.3f}}")
"""


def cold_start(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh process to its first compiled decode step, with an empty inductor cache, then a filled one."""
    code = _COLD.format(threads=args.threads, model=args.model, scope=args.scope, dynamic={"true": True, "none": None}[args.dynamic])
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
        for label in ("empty cache", "filled cache"):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            load_s, batch8_s, batch1_s = (float(x) for x in res.stdout.split()[-3:])
            out[label] = {"process_s": time.perf_counter() - t0, "load_and_prefill_s": load_s,
                          "first_compiled_step_s": batch8_s, "first_compiled_batch1_step_s": batch1_s,
                          "to_both_decode_graphs_s": load_s + batch8_s + batch1_s}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.compile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = {} if args.cold_start_only else measure(args)
    if args.cold_start or args.cold_start_only:
        r["cold_start"] = cold_start(args)
    print(json.dumps(r, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
