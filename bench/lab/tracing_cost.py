"""What tracing costs: the same trace on three identical 1e1p1d clusters in one `mserve bench compare` run.

    python -m lab.tracing_cost --model models/tiny-llava --rate 50 --out tracing-cost/

The clusters: tracing off; every request traced; one in ten traced (OTEL_TRACES_SAMPLER
parentbased_traceidratio, 0.1). The traced ones export over OTLP/HTTP to a real receiver in this
process (lab/otlp_sink.py), each cluster has its own Redis, and the trace is small text requests
(16 words, 8 tokens), so the coordinator's per-request work is what is measured. Ratios are against
the untraced cluster; bench/lab/NOTEBOOK.md ("Tracing cost") has a run's table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from contextlib import ExitStack

from lab.otlp_sink import OtlpReceiver
from mserve.common.redis_server import RedisServer
from mserve.coordinator.launcher import LocalCluster


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (mserve make-tiny-model)")
    p.add_argument("--rate", default="50", help="requests/s (default 50)")
    p.add_argument("--num-requests", default="300")
    p.add_argument("--out", default="tracing-cost", help="the compare run's folder")
    args = p.parse_args()
    with ExitStack() as stack:
        otlp = stack.enter_context(OtlpReceiver())
        traced = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint}
        sampled = {**traced, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        addresses = []
        for env in ({}, traced, sampled):
            redis = stack.enter_context(RedisServer())
            saved = dict(os.environ)
            os.environ.update(env)  # the cluster's processes read the standard variables
            try:
                cluster = stack.enter_context(LocalCluster(args.model, redis_url=redis.url, encode=1, prefill=1,
                                                           decode=1))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            addresses.append(cluster.address.removeprefix("tcp://"))
        print("configurations: tracing off, every request traced, 1 in 10 traced", flush=True)
        cmd = [sys.executable, "-m", "mserve.cli", "bench", "compare", "--model", args.model,
               "--configs", ",".join(f"zmq://{a}" for a in addresses), "--trace", "text",
               "--rate", args.rate, "--num-requests", args.num_requests, "--max-tokens", "8",
               "--prompt-tokens", "16", "--ignore-eos", "--seed", "0", "--no-plots", "--no-progress",
               "--out", args.out]
        subprocess.run(cmd, check=True)
        print(f"spans received: {len(otlp.spans)} in {len({s.trace_id for s in otlp.spans})} traces")


if __name__ == "__main__":
    main()
