"""Vision forwards one image at a time against batches (the encode worker's `max_encode_images`).

`PYTHONPATH=bench .venv/bin/python -m lab.encode_batch --model DIR --dtype bfloat16 --batches 1,2,8`
runs the worker's own encode path (`ModelRunner.encode_images`: the image processor and the model's
get_image_features) over the same images in batches of each size, alternating the sizes round by
round, and prints the median ms an image for each. One torch thread, as a worker has by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from PIL import Image

from mserve.workers.model_runner import ModelRunner


def images(n: int, size: tuple[int, int], seed: int = 0) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())
            for _ in range(n)]


def per_image_ms(runner: ModelRunner, ims: list[Image.Image], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(ims), batch):
        runner.encode_images(ims[i:i + batch])
    return 1000 * (time.perf_counter() - t0) / len(ims)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (mserve make-tiny-model, or small-llava)")
    p.add_argument("--dtype", default=None, help="model dtype (default: the worker's for the CPU)")
    p.add_argument("--batches", default="1,2,8", help="batch sizes, comma-separated (default 1,2,8)")
    p.add_argument("--images", type=int, default=8, help="images a round, per batch size (default 8)")
    p.add_argument("--size", default="640x480", help="image width x height before the processor (default 640x480)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batches.split(",")]
    w, h = (int(x) for x in args.size.split("x"))
    runner = ModelRunner(args.model, dtype=args.dtype, parts="vision")
    ims = images(args.images, (w, h))
    for b in sizes:  # first forwards of each shape: untimed
        per_image_ms(runner, ims[:b], b)
    rounds: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(args.rounds):
        for b in sizes:
            rounds[b].append(per_image_ms(runner, ims, b))
    print(json.dumps({"model": args.model, "dtype": str(runner.dtype), "images": args.images, "size": args.size,
                      "ms_per_image": {b: round(statistics.median(v), 2) for b, v in rounds.items()},
                      "rounds": {b: [round(x, 2) for x in v] for b, v in rounds.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
