"""What a stalled Redis costs a stream: one long stream with Redis answering, then one with it paused.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.redis_stall --model DIR [--layout unified] [--tokens 1500]

Starts a private redis-server and a local cluster on it (`--layout unified`: one unified worker;
`1e1p1d`: encode, prefill and decode), sends one image request to warm it, then streams `--tokens`
tokens of a text request twice: with Redis answering, and with the server paused (SIGSTOP), which is
how a stalled or black-holed Redis looks: connections open, no answer, each call waiting the socket
timeout (`--redis-timeout-s`, default 0.5 s, for every process). Prints each stream's time, its longest
gap between token events, and how many gaps were over 0.3 s. Used for the closing note of the Redis
lane (common/redis_lane.py); the tests that hold the behaviour are tests/workers/test_redis_stall_worker.py and
tests/coordinator/test_redis_stall_cluster.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import time


def main(argv: list[str] | None = None) -> int:
    from mserve.common.redis_server import RedisServer, find_redis_server
    from mserve.coordinator.client import Client
    from mserve.coordinator.launcher import LocalCluster

    p = argparse.ArgumentParser(prog="python -m lab.redis_stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (e.g. a `mserve make-tiny-model` one)")
    p.add_argument("--layout", choices=["unified", "1e1p1d"], default="unified")
    p.add_argument("--tokens", type=int, default=1500, help="tokens per stream (default 1500)")
    p.add_argument("--redis-timeout-s", type=float, default=0.5, help="every process's Redis timeout (default 0.5)")
    args = p.parse_args(argv)
    roles = dict(encode=0, prefill=0, decode=0, unified=1) if args.layout == "unified" else \
        dict(encode=1, prefill=1, decode=1, unified=0)
    timeout = ["--redis-timeout-s", str(args.redis_timeout_s)]
    server = RedisServer(binary=find_redis_server()).start()
    paused = False
    try:
        with LocalCluster(args.model, redis_url=server.url, extra_worker_args=timeout, extra_coordinator_args=timeout,
                          **roles) as cluster, Client(cluster.address, timeout_s=120) as client:
            image = {"type": "image", "image": _png(64, 64)}
            client.generate([{"role": "user", "content": [image, {"type": "text", "text": "hello"}]}], max_tokens=8)
            for paused in (False, True):
                if paused:
                    os.kill(server.pid, signal.SIGSTOP)
                times = []
                t0 = time.monotonic()
                for _ in client.stream([{"role": "user", "content": "Tell me a long story."}],
                                       max_tokens=args.tokens, ignore_eos=True):
                    times.append(time.monotonic())
                gaps = [b - a for a, b in zip([t0] + times, times)]
                print(f"redis {'paused  ' if paused else 'answering'}: {len(times)} token events in "
                      f"{times[-1] - t0:.2f} s, longest gap {max(gaps) * 1000:.0f} ms, "
                      f"{sum(g > 0.3 for g in gaps)} gaps over 300 ms", flush=True)
            os.kill(server.pid, signal.SIGCONT)
            paused = False
    finally:
        if paused:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
    return 0


def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (40, 120, 200)).save(out, format="PNG")
    return out.getvalue()


if __name__ == "__main__":
    raise SystemExit(main())
