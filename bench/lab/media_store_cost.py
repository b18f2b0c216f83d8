"""The coordinator with and without a media store: its CPU and bytes per request carrying a ~4 MB image.

    python -m lab.media_store_cost --model models/tiny-llava --requests 12

One 1e1p1d cluster; the same number of sequential requests, each with its own random-noise PNG of about
4 MB, first sent inline, then through a client's media store (common/media_store.py). For each: the
coordinator's CPU per request (its /proc stat, user + system), the GENERATE body's bytes, the media bytes
the coordinator carried (its `media_bytes_inline` stat: what ENCODE then carries on), and requests/s.
The CPU figures are exact to the kernel's tick (10 ms) over the requests; req/s needs a quiet host.
"""

from __future__ import annotations

import argparse
import io
import os
import time

import numpy as np
from PIL import Image

from mserve.common.media_store import MediaStore
from mserve.common.redis_server import RedisServer
from mserve.common.serde import encode
from mserve.coordinator.client import Client
from mserve.coordinator.client_core import generate_body
from mserve.coordinator.launcher import LocalCluster


def big_image(seed: int, side: int = 1180) -> bytes:
    """Noise, barely compressed: side² · 3 bytes of PNG (about 4.2 MB at 1180)."""
    arr = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat(image: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]


def measure(cluster: LocalCluster, images: list[bytes], store: MediaStore | None) -> dict[str, float]:
    pid = cluster.processes["coordinator"].pid
    with Client(cluster.address, timeout_s=120, media_store=store) as c:
        c.generate(chat(images[0]), max_tokens=4)  # warm-up
        inline0, cpu0, t0 = c.status()["stats"]["media_bytes_inline"], cpu_s(pid), time.perf_counter()
        for image in images[1:]:
            c.generate(chat(image), max_tokens=4)
        wall, cpu, inline = time.perf_counter() - t0, cpu_s(pid) - cpu0, c.status()["stats"]["media_bytes_inline"] - inline0
    body = generate_body("x", chat(images[1]), False)
    body = store.store_messages(body) if store is not None else body
    n = len(images) - 1
    return {"cpu_ms": cpu / n * 1e3, "generate_bytes": sum(len(f) for f in encode(1, body)),
            "media_bytes_inline": inline / n, "req_s": n / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (mserve make-tiny-model)")
    p.add_argument("--requests", type=int, default=12)
    args = p.parse_args()
    images = [big_image(seed) for seed in range(2 * (args.requests + 1))]
    print(f"{len(images[0])} bytes per image, {args.requests} requests each way")
    with RedisServer() as redis, LocalCluster(args.model, encode=1, prefill=1, decode=1, redis_url=redis.url) as cluster:
        rows = {"inline": measure(cluster, images[:args.requests + 1], None)}
        with MediaStore() as store:
            rows["store"] = measure(cluster, images[args.requests + 1:], store)
    for mode, r in rows.items():
        print(f"{mode:6s} coordinator CPU {r['cpu_ms']:6.2f} ms/request  GENERATE {r['generate_bytes']:>9d} B  "
              f"media through the coordinator {r['media_bytes_inline']:>9.0f} B/request  {r['req_s']:.2f} req/s")


if __name__ == "__main__":
    main()
