"""The README's first run: starts a local 1E+1P+1D cluster, sends a few image+text requests at once, prints the answers.

    python -m mserve.demo --model models/tiny-llava [--n 3]

A tiny random-weight checkpoint answers with noise; the point is the path and the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import sys
import time
from typing import Any

import numpy as np
from PIL import Image

QUESTIONS: list[tuple[str, tuple[int, int] | None]] = [
    ("What colours do you see in this picture?", (640, 480)),
    ("Describe the pattern in this image.", (1280, 720)),
    ("What is the capital of France?", None),
]


def gradient_image(width: int, height: int) -> bytes:
    """Red on the left fading to blue on the right."""
    t = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :].repeat(height, axis=0)
    rgb = np.stack([255 * (1 - t), np.zeros_like(t), 255 * t], axis=-1).astype(np.uint8)
    return _png(rgb)


def pattern_image(width: int, height: int, cell: int = 80) -> bytes:
    """A checkerboard of yellow and teal cells with a white diagonal band."""
    y, x = np.mgrid[0:height, 0:width]
    checker = ((x // cell + y // cell) % 2).astype(bool)
    rgb = np.where(checker[..., None], [240, 200, 40], [20, 140, 150]).astype(np.uint8)
    rgb[np.abs(x * height / width - y) < 12] = 255
    return _png(rgb)


def _png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def build_requests(n: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """(question, chat messages) pairs, cycling through the built-in questions."""
    out = []
    for i in range(n):
        question, size = QUESTIONS[i % len(QUESTIONS)]
        content: list[dict[str, Any]] = []
        if size is not None:
            image = gradient_image(*size) if i % 2 == 0 else pattern_image(*size)
            content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": question})
        label = f"[{size[0]}x{size[1]} image] {question}" if size else question
        out.append((label, [{"role": "user", "content": content}]))
    return out


async def run_requests(address: str, requests: list[tuple[str, list[dict[str, Any]]]], max_tokens: int,
                       timeout_s: float) -> list[Any]:
    """All requests at once over one AsyncClient; each entry is a GenerateResult or the exception."""
    from mserve.coordinator.client import AsyncClient

    async with AsyncClient(address, timeout_s=timeout_s) as client:
        return await asyncio.gather(*(client.generate(msgs, max_tokens=max_tokens) for _, msgs in requests),
                                    return_exceptions=True)


def print_result(i: int, question: str, result: Any) -> bool:
    print(f"\n#{i + 1} Q: {question}")
    if isinstance(result, BaseException):
        print(f"   FAILED: {type(result).__name__}: {result}")
        return False
    t = result.timings
    ms = "  ".join(f"{k} {1000 * t.get(f'{k}_s', 0.0):.0f}" for k in ("queue", "encode", "prefill", "transfer",
                                                                         "decode", "total"))
    print(f"   A: {result.text!r}")
    print(f"   {len(result.token_ids)} tokens, finish: {result.finish_reason}, prompt {result.prompt_tokens} tokens "
          f"({result.visual_tokens} visual)")
    print(f"   ms: {ms}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mserve.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local checkpoint folder (mserve make-tiny-model)")
    parser.add_argument("--n", type=int, default=3, help="number of requests, sent concurrently (default 3)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer at most (default 24)")
    parser.add_argument("--redis", default=None, metavar="URL", help="existing redis (default: a private one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request and for start-up")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from mserve.coordinator.launcher import ClusterStartError, LocalCluster

    requests = build_requests(args.n)
    print(f"starting a 1 encode + 1 prefill + 1 decode cluster on {args.model} ...", flush=True)
    t0 = time.perf_counter()
    try:
        with LocalCluster(args.model, redis_url=args.redis, threads=args.threads).start(args.timeout) as cluster:
            print(f"cluster up at {cluster.address} in {time.perf_counter() - t0:.1f}s; "
                  f"sending {len(requests)} requests at once", flush=True)
            t1 = time.perf_counter()
            results = asyncio.run(run_requests(cluster.address, requests, args.max_tokens, args.timeout))
            wall = time.perf_counter() - t1
    except (ClusterStartError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ok = [print_result(i, q, r) for i, ((q, _), r) in enumerate(zip(requests, results))]
    print(f"\n{sum(ok)}/{len(ok)} requests answered in {wall:.2f}s wall time "
          "(a random-weight checkpoint answers with noise)")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
