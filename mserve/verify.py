"""`mserve verify --model DIR`: the load-time exactness probe by hand (workers/probe.py).

Prints the traits found, then one row per case (prompt tokens, tokens compared, HF and engine
seconds, the chunking or prefix hit it exercised) and the verdict; --json prints the verdict as JSON.
Exit status 0 when served, 1 when refused. It always probes afresh and refreshes the cached verdict.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--device", default="cpu", help="device the engine and HF run on (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on CPU, bfloat16 on CUDA, as a worker)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")


def table(verdict: dict) -> str:
    traits = ", ".join(f"{k}={v}" for k, v in verdict["traits"].items() if v not in (None, False, {}))
    lines = [f"model_type {verdict['model_type']} ({verdict['dtype']}); traits: {traits}", "",
             f"{'case':<28} {'prompt':>6} {'same':>6} {'hf s':>6} {'engine s':>8}  detail",
             "-" * 78]
    for c in verdict["cases"]:
        same = f"{c['compared'] if c['ok'] else c['mismatch']}/{len(c['expected'])}"
        lines.append(f"{c['name']:<28} {c['prompt_tokens']:>6} {same:>6} {c['hf_seconds']:>6.2f} "
                     f"{c['engine_seconds']:>8.2f}  {'' if c['ok'] else 'MISMATCH '}{c['detail']}")
    lines += ["", f"{'SERVED' if verdict['served'] else 'REFUSED'}: {verdict['reason']} ({verdict['seconds']:.1f} s)"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from mserve.workers.verdicts import cached_verdict

    verdict, _ = cached_verdict(args.model, args.device, args.dtype, refresh=True)
    print(json.dumps(verdict, indent=1) if args.json else table(verdict))
    return 0 if verdict["served"] else 1
