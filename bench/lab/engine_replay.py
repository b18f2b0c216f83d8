"""A saved trace's requests through one in-process engine, N at a time: where a request's time goes.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.engine_replay --model DIR --trace OUT/trace.jsonl \\
        [--requests 48] [--concurrency 16] [--max-tokens 64] [--dtype bfloat16] [--attention padded] [--max-prefill-tokens 512]

`trace.jsonl` is what `mserve bench compare` writes into its --out folder. Every request is greedy,
ignores EOS and makes --max-tokens tokens, like the bench's `--ignore-eos`. Reports the wall time per
request, split into steps that carry prompt tokens (prefill, with the decode tokens riding along),
decode-only steps, and vision encoding (inside adding a request), with how many steps of each kind.
One torch thread, like a worker.
Used for bench/lab/NOTEBOOK.md, "Why 1.3x per core is out of reach".
"""

from __future__ import annotations

import argparse
import time


def prompts(model: str, trace: str, n: int) -> list:
    """The first `n` requests' prompts, built from their messages as the coordinator builds them."""
    from mserve.bench.traces import load_trace
    from mserve.common.prompt import PromptBuilder

    builder = PromptBuilder(model)
    return [builder.prepare(req.messages) for req in load_trace(trace)[:n]]


def main(argv: list[str] | None = None) -> int:
    import torch

    from mserve.common.policy import DEFAULT_ENGINE
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.paged_attention import exact_setting
    from mserve.workers.sequence import SamplingParams

    p = argparse.ArgumentParser(prog="python -m lab.engine_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--trace", required=True, help="a bench run's trace.jsonl (image parts inline)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: the checkpoint's on CPU, float32)")
    p.add_argument("--attention", choices=["auto", "exact", "padded"], default="auto",
                   help="as a worker's --attention (default auto)")
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_ENGINE.max_prefill_tokens,
                   help="prompt tokens per step, as a worker's flag (default: a worker's, %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    reqs = prompts(args.model, args.trace, args.requests)
    engine = Engine(EngineConfig(args.model, dtype=args.dtype, exact_attention=exact_setting(args.attention),
                                 max_prefill_tokens=args.max_prefill_tokens))
    spent = {"encode": 0.0, "prefill steps": 0.0, "decode-only steps": 0.0}
    steps = {"prefill steps": 0, "decode-only steps": 0}
    encode = engine.encode

    def timed_encode(*a, **kw):
        t = time.perf_counter()
        try:
            return encode(*a, **kw)
        finally:
            spent["encode"] += time.perf_counter() - t

    engine.encode = timed_encode
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    waiting, running, done, t0 = list(enumerate(reqs)), 0, 0, time.perf_counter()
    while done < len(reqs):
        while running < args.concurrency and waiting:
            i, pp = waiting.pop(0)
            engine.add_request(f"r{i}", pp.prompt_ids, images=pp.images, sampling=sampling)
            running += 1
        before, t = engine.counters["prefill_tokens"], time.perf_counter()
        finished = sum(o.finished for o in engine.step())
        kind = "prefill steps" if engine.counters["prefill_tokens"] != before else "decode-only steps"
        spent[kind] += time.perf_counter() - t
        steps[kind] += 1
        done, running = done + finished, running - finished
    wall = time.perf_counter() - t0
    tokens = sum(len(pp.prompt_ids) for pp in reqs) / len(reqs)
    print(f"{len(reqs)} requests, {tokens:.0f} prompt tokens on average, {args.concurrency} at a time: "
          f"{wall:.1f} s, {wall / len(reqs) * 1e3:.0f} ms per request")
    prompt_tokens = engine.counters["prefill_tokens"]
    for k, v in spent.items():
        count = ""
        if k == "prefill steps" and steps[k]:
            count = f" ({steps[k]} steps, {prompt_tokens / steps[k]:,.0f} prompt tokens a step)"
        elif k in steps:
            count = f" ({steps[k]} steps, {v / max(steps[k], 1) * 1e3:.1f} ms a step)"
        print(f"  {k}: {v:.1f} s, {v / len(reqs) * 1e3:.0f} ms per request{count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
