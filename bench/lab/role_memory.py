"""Resident memory of each worker role beside the whole-model (unified) worker, from a live cluster.

    python -m lab.role_memory --model DIR [--json-out FILE]

Starts one worker of every role (encode, prefill, decode, unified) on a private Redis, waits for
their load reports, and prints each one's resident memory as it reports it (Linux /proc).
Lean roles keep half the weights: encode the vision tower + projector, prefill/decode the
language model + head; the unified worker keeps the whole model.
"""

from __future__ import annotations

import argparse
import json
import time


def measure(model: str, settle_s: float = 3.0) -> dict[str, float]:
    from mserve.coordinator.client import Client
    from mserve.coordinator.launcher import LocalCluster

    with LocalCluster(model, encode=1, prefill=1, decode=1, unified=1) as cluster, Client(cluster.address) as c:
        deadline = time.monotonic() + 60
        while True:
            workers = c.status()["workers"]
            rss = {w["role"]: w["load"].get("rss_mib", 0.0) for w in workers.values() if w["alive"]}
            if len(rss) == 4 and all(rss.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not report their memory: {rss}")
            time.sleep(0.2)
        time.sleep(settle_s)  # a few heartbeats later: steady state after start-up
        workers = c.status()["workers"]
        return {w["role"]: {k: w["load"][k] for k in ("weights_mib", "kv_pool_mib", "rss_mib")}
                for w in workers.values() if w["alive"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.role_memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--json-out", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    mem = measure(a.model)
    whole = mem["unified"]
    print("| role | weights kept | weights MiB | KV pool MiB | resident MiB | resident vs unified |")
    print("|---|---|---|---|---|---|")
    kept = {"encode": "vision tower + projector", "prefill": "language model + head",
            "decode": "language model + head", "unified": "whole model"}
    for role in ("encode", "prefill", "decode", "unified"):
        m = mem[role]
        print(f"| {role} | {kept[role]} | {m['weights_mib']:.1f} | {m['kv_pool_mib']:.0f} | {m['rss_mib']:.0f} | "
              f"{m['rss_mib'] / whole['rss_mib']:.2f}x |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(mem, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
