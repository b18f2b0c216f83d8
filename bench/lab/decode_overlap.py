"""Image decoding beside the vision forward (issue #20 item 3): does a decode thread pool pay?

`PYTHONPATH=bench .venv/bin/python -m lab.decode_overlap --model models/small-llava` runs the encode
role's batch loop on one engine two ways, alternating, in one process: decode a batch's images then run
its vision forward (as the worker does), or decode the next batch on `--decode-threads` threads while
the current batch's forward runs. Decoding here is `Engine.decode_visual` (PIL decode within the pixel
limit); the image processor runs inside the forward's call either way.

`--unified`: the unified role instead, where a RUN request's images are decoded at admission, on the
loop (stalling every running decode meanwhile) or ahead on an IO thread (`Engine.predecoded`). It times
the loop's part of admitting one image request both ways, alternating: `add_request` with the bytes,
and `add_request` with the images decoded beforehand (the IO thread's part is not on the loop).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from mserve.workers.engine import Engine, EngineConfig


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    pixels = (base + rng.normal(0, 40, base.shape)).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def sequential(engine: Engine, batches: list[list[bytes]]) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        engine.runner.encode_visuals([engine.decode_visual(b) for b in batch])
    return time.perf_counter() - t0


def overlapped(engine: Engine, batches: list[list[bytes]], pool: ThreadPoolExecutor) -> float:
    t0 = time.perf_counter()
    nxt = [pool.submit(engine.decode_visual, b) for b in batches[0]]
    for i in range(len(batches)):
        current = [f.result() for f in nxt]
        if i + 1 < len(batches):
            nxt = [pool.submit(engine.decode_visual, b) for b in batches[i + 1]]
        engine.runner.encode_visuals(current)
    return time.perf_counter() - t0


def admission(model: str, images: list[bytes], rounds: int) -> dict:
    from mserve.common.prompt import PromptBuilder
    from mserve.common.video import visual_hash

    engine = Engine(EngineConfig(model, enable_prefix_caching=False))
    builder = PromptBuilder(model)
    prompts = [builder.prepare_text("Describe it.", [im]).prompt_ids for im in images]
    on_loop, ahead = [], []
    for r in range(rounds):
        for i, (im, ids) in enumerate(zip(images, prompts)):
            t0 = time.perf_counter()
            engine.add_request(f"a{r}-{i}", ids, images=[im])
            on_loop.append(time.perf_counter() - t0)
            engine.abort(f"a{r}-{i}")
            engine.predecoded[visual_hash(im)] = engine.decode_visual(im)  # the IO thread's part
            t0 = time.perf_counter()
            engine.add_request(f"b{r}-{i}", ids, images=[im])
            ahead.append(time.perf_counter() - t0)
            engine.abort(f"b{r}-{i}")
    return {"admission_ms_decoding_on_loop": round(statistics.median(on_loop) * 1e3, 1),
            "admission_ms_decoded_ahead": round(statistics.median(ahead) * 1e3, 1),
            "loop_ms_saved_per_image": round((statistics.median(on_loop) - statistics.median(ahead)) * 1e3, 1),
            "samples": len(on_loop)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.decode_overlap", description=__doc__)
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--batches", type=int, default=8, help="encode batches per run (default 8)")
    p.add_argument("--batch", type=int, default=4, help="images per batch (default 4)")
    p.add_argument("--size", default="1024x768", help="image size WxH, JPEG (default 1024x768)")
    p.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds; medians reported")
    p.add_argument("--decode-threads", type=int, default=2, help="decode threads (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a worker)")
    p.add_argument("--unified", action="store_true", help="time a unified worker's admission of an image "
                   "request instead (decoded on the loop, or ahead)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    w, h = (int(x) for x in a.size.split("x"))
    if a.unified:
        result = admission(a.model, [jpeg(w, h, seed=i) for i in range(a.batch)], a.rounds)
        print(json.dumps({"model": a.model, "size": a.size, **result}, indent=1))
        return 0
    engine = Engine(EngineConfig(a.model, parts="vision", num_blocks=16))
    batches = [[jpeg(w, h, seed=b * a.batch + i) for i in range(a.batch)] for b in range(a.batches)]
    t0 = time.perf_counter()
    decode_s = sum(1 for batch in batches for b in batch if engine.decode_visual(b) is not None)
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pil = [[engine.decode_visual(b) for b in batch] for batch in batches]
    for batch in pil:
        engine.runner.encode_visuals(batch)
    forward_s = time.perf_counter() - t0 - decode_s
    off, on = [], []
    with ThreadPoolExecutor(a.decode_threads) as pool:
        for _ in range(a.rounds):
            off.append(sequential(engine, batches))
            on.append(overlapped(engine, batches, pool))
    print(json.dumps({"model": a.model, "images": a.batches * a.batch, "size": a.size,
                      "decode_only_s": round(decode_s, 3), "forward_s_approx": round(forward_s, 3),
                      "sequential_s": round(statistics.median(off), 3), "overlapped_s": round(statistics.median(on), 3),
                      "rounds_off": [round(x, 3) for x in off], "rounds_on": [round(x, 3) for x in on],
                      "speedup": round(statistics.median(off) / statistics.median(on), 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
