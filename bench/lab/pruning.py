"""What visual-token pruning (--visual-token-pruning, FasterVLM) costs and buys, measured at the engine.

    python -m lab.pruning --model models/small-llava --requests 24 --max-tokens 32

Over a seeded trace of single-image prompts (bench/traces.py, the `image` trace), every request
runs through one engine per keep ratio (and an unpruned one), one request at a time, in the same
process, sharing one copy of the weights; the configurations take turns request by request, so drift
on a shared host hits them alike. Greedy decoding with EOS ignored: every request yields exactly
--max-tokens tokens, so outputs can be compared position by position.

Reported per ratio: visual tokens per image; agreement with the unpruned model's greedy tokens (share
of identical tokens by position, share of requests whose whole output is identical, mean tokens before
the first difference); encode time (decode + vision tower + ranking), prefill time (until the first
token), end-to-end time (encode + prefill + decode), and the speed-ups (unpruned total time / pruned
total time). Engine-level, not a served cluster: no network, queueing or transfers.

On a random-weight checkpoint (`mserve make-tiny-model`), agreement says how far pruning moves the
output, not how good the answers are: a trained model ranks tokens by meaningful attention and has
redundant image content to lose; random weights have neither.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

log = logging.getLogger("lab.pruning")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lab.pruning", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local llava checkpoint folder (e.g. models/small-llava)")
    p.add_argument("--ratios", default="1.0,0.75,0.5,0.25", help="keep ratios to compare (default 1.0,0.75,0.5,0.25)")
    p.add_argument("--requests", type=int, default=24, help="image prompts in the trace (default 24)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request, EOS ignored (default 32)")
    p.add_argument("--prompt-words", type=int, default=32, help="words of text per prompt (default 32)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def _agreement(ref: list[int], out: list[int]) -> tuple[int, int]:
    """(identical tokens by position, tokens before the first difference)."""
    same = sum(a == b for a, b in zip(ref, out))
    prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    return same, prefix


def run_one(engine: Any, rid: str, prompt_ids: list[int], images: list[bytes], sampling: Any) -> dict[str, Any]:
    """One request alone through `engine`: its output and the time of each stage."""
    t0 = time.perf_counter()
    encoded = engine.encode(images)
    t1 = time.perf_counter()
    engine.add_request(rid, prompt_ids, encoded=encoded, image_hashes=[f"{rid}-{i}" for i in range(len(images))],
                       sampling=sampling)
    out: list[int] = []
    t_first = None
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
            if t_first is None:
                t_first = time.perf_counter()
    t2 = time.perf_counter()
    return {"tokens": out, "encode_s": t1 - t0, "prefill_s": (t_first or t2) - t1, "decode_s": t2 - (t_first or t2),
            "e2e_s": t2 - t0, "visual_tokens": sum(int(e.embeds.shape[0]) for e in encoded) / max(len(images), 1)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mserve.bench.traces import make_trace
    from mserve.common.prompt import PromptBuilder
    from mserve.workers.engine import Engine, EngineConfig
    from mserve.workers.model_loading import load_vlm
    from mserve.workers.sequence import SamplingParams

    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    configs: list[float | None] = [None, *ratios]
    model = load_vlm(args.model, args.device)
    builders = {r: PromptBuilder(args.model, visual_token_pruning=r) for r in configs}
    engines = {r: Engine(EngineConfig(args.model, device=args.device, num_blocks=256, enable_prefix_caching=False,
                                      visual_token_pruning=r), model=model) for r in configs}
    trace = make_trace("image", args.requests, args.seed, max_tokens=args.max_tokens, prompt_tokens=args.prompt_words)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {r: [builders[r].prepare(req.messages) for req in trace] for r in configs}
    for r in configs:  # warm-up: first-call allocations stay out of the figures
        run_one(engines[r], "warmup", prompts[r][0].prompt_ids, prompts[r][0].images, sampling)
    runs: dict[float | None, list[dict[str, Any]]] = {r: [] for r in configs}
    t0 = time.perf_counter()
    for i, req in enumerate(trace):
        for r in configs:  # take turns, request by request
            pp = prompts[r][i]
            runs[r].append(run_one(engines[r], req.request_id, pp.prompt_ids, pp.images, sampling))
        log.info("request %d/%d done (%.0f s)", i + 1, len(trace), time.perf_counter() - t0)
    return {"args": vars(args), "rows": summarize(runs), "image_sizes": [list(req.image_sizes[0]) for req in trace]}


def summarize(runs: dict[float | None, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    base = runs[None]
    total = {k: sum(x[k] for x in base) for k in ("encode_s", "prefill_s", "e2e_s")}
    rows = []
    for r, rs in runs.items():
        same = prefix = tokens = exact = 0
        for ref, x in zip(base, rs):
            s, p = _agreement(ref["tokens"], x["tokens"])
            same, prefix, tokens = same + s, prefix + p, tokens + len(ref["tokens"])
            exact += ref["tokens"] == x["tokens"]
        sums = {k: sum(x[k] for x in rs) for k in ("encode_s", "prefill_s", "e2e_s")}
        rows.append({
            "keep_ratio": "off" if r is None else r,
            "visual_tokens": statistics.mean(x["visual_tokens"] for x in rs),
            "token_agreement": same / max(tokens, 1),
            "exact_match_rate": exact / max(len(rs), 1),
            "tokens_before_first_difference": prefix / max(len(rs), 1),
            "encode_ms": 1000 * sums["encode_s"] / len(rs),
            "prefill_ms": 1000 * sums["prefill_s"] / len(rs),
            "e2e_ms": 1000 * sums["e2e_s"] / len(rs),
            "prefill_ms_median": 1000 * statistics.median(x["prefill_s"] for x in rs),
            "encode_speedup": total["encode_s"] / sums["encode_s"],
            "prefill_speedup": total["prefill_s"] / sums["prefill_s"],
            "e2e_speedup": total["e2e_s"] / sums["e2e_s"],
        })
    return rows


def render(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"{a['requests']} single-image prompts (`image` trace, seed {a['seed']}), {a['max_tokens']} greedy tokens "
             f"each (EOS ignored), {a['threads']} thread(s), {a['device']}; engine-level, one request at a time",
             "",
             "| keep ratio | visual tokens / image | token agreement | exact-match requests | tokens before 1st diff "
             "| encode ms | prefill ms (median) | end-to-end ms | prefill speed-up | end-to-end speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['keep_ratio']} | {r['visual_tokens']:.0f} | {100 * r['token_agreement']:.1f} % "
                     f"| {100 * r['exact_match_rate']:.0f} % | {r['tokens_before_first_difference']:.1f} "
                     f"| {r['encode_ms']:.1f} | {r['prefill_ms']:.1f} ({r['prefill_ms_median']:.1f}) "
                     f"| {r['e2e_ms']:.1f} | {r['prefill_speedup']:.2f}x | {r['e2e_speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    result = measure(args)
    print(render(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
