"""Container health probes: `python -m mserve.healthcheck KIND ...` exits 0 when healthy, 1 when not, and
prints one line saying why. Used by deploy/docker-compose.yml and the Kubernetes manifests (deploy/k8s/).

* `coordinator --coordinator ADDR`: the coordinator answers STATUS on its client address (what
  `mserve status` checks, without reading Redis or printing tables).
* `worker --ready --coordinator ADDR`: the coordinator lists this worker as alive: its model is loaded,
  it has said READY and its heartbeats arrive. For readiness and start-up probes.
* `worker --redis URL`: this worker's load in Redis was published within --max-age-s (its heartbeat
  thread runs). For liveness: where Redis cannot be read the coordinator's view decides (with
  --coordinator), and where neither can be read the worker counts as healthy: it is not restarted for
  another component's outage.
* `http URL`: the URL answers 2xx (the gateway's /health answers 503 while no worker can serve).

The worker's id is --worker-id, default $MSERVE_WORKER_ID (the manifests set it to the pod's name).
Only zmq/redis clients are imported: a probe takes a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def worker_verdict(worker_id: str, *, ready: bool, coordinator: dict[str, Any] | None, coordinator_error: str | None,
                   loads: dict[str, dict[str, Any]] | None, now: float, max_age_s: float) -> tuple[bool, str]:
    """(healthy, why) from what could be read: the coordinator's STATUS reply and this worker's Redis load
    (None: that source was not read)."""
    seen = (coordinator or {}).get("workers") or {}
    entry = seen.get(worker_id) if isinstance(seen, dict) else None
    if ready:
        if coordinator is None:
            return False, f"coordinator not reachable: {coordinator_error}"
        if not isinstance(entry, dict):
            return False, f"the coordinator does not know worker {worker_id!r} (yet)"
        return (True, "alive at the coordinator") if entry.get("alive") else (False, "the coordinator holds it dead")
    if loads is not None:
        load = loads.get(worker_id)
        published = (load or {}).get("updated_at")
        if not isinstance(published, (int, float)):
            return False, f"no load of worker {worker_id!r} in Redis"
        age = now - published
        return (age <= max_age_s, f"load published {age:.1f}s ago (limit {max_age_s:g}s)")
    if coordinator is not None and isinstance(entry, dict):
        return (bool(entry.get("alive")), "Redis not read; the coordinator holds it "
                + ("alive" if entry.get("alive") else "dead"))
    return True, "neither Redis nor the coordinator could be read: not this worker's fault"


def _read_coordinator(address: str | None, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    if not address:
        return None, "no --coordinator given"
    from mserve.status import read_coordinator

    return read_coordinator(address, timeout_s)


def _read_loads(url: str | None, worker_id: str, timeout_s: float) -> dict[str, dict[str, Any]] | None:
    if not url:
        return None
    from mserve.common.redis_store import RedisStore

    logging.getLogger("mserve.common.redis_store").setLevel(logging.ERROR)  # the verdict says it instead
    store = RedisStore(url, socket_timeout_s=timeout_s)
    try:
        if not store.ping():
            return None
        loads = store.get_loads([worker_id])
        return loads if store.healthy else None
    finally:
        store.close()


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (a local probe URL)
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{exc.__class__.__name__}: {exc}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mserve.healthcheck", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)
    c = sub.add_parser("coordinator", help="the coordinator answers STATUS")
    c.add_argument("--coordinator", default="tcp://127.0.0.1:5555", help="its client address (default %(default)s)")
    w = sub.add_parser("worker", help="this worker is alive (liveness) or registered and alive (--ready)")
    w.add_argument("--worker-id", default=os.environ.get("MSERVE_WORKER_ID"),
                   help="default $MSERVE_WORKER_ID")
    w.add_argument("--coordinator", help="the coordinator's client address (its --bind, not --worker-bind)")
    w.add_argument("--redis", default=os.environ.get("MSERVE_REDIS"), help="default $MSERVE_REDIS")
    w.add_argument("--ready", action="store_true", help="require the coordinator to list this worker alive")
    w.add_argument("--max-age-s", type=float, default=15.0, help="oldest acceptable load in Redis (default 15)")
    h = sub.add_parser("http", help="a URL answers 2xx")
    h.add_argument("url")
    for sp in (c, w, h):
        sp.add_argument("--timeout", type=float, default=3.0, help="seconds per call (default 3)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.kind == "coordinator":
        reply, error = _read_coordinator(a.coordinator, a.timeout)
        ok, why = reply is not None, error or "answers STATUS"
    elif a.kind == "http":
        ok, why = check_http(a.url, a.timeout)
    else:
        if not a.worker_id:
            print("unhealthy: no --worker-id and no $MSERVE_WORKER_ID", file=sys.stderr)
            return 1
        reply, error = _read_coordinator(a.coordinator, a.timeout)
        loads = None if a.ready else _read_loads(a.redis, a.worker_id, a.timeout)
        ok, why = worker_verdict(a.worker_id, ready=a.ready, coordinator=reply, coordinator_error=error, loads=loads,
                                 now=time.time(), max_age_s=a.max_age_s)
    print(f"{'healthy' if ok else 'unhealthy'}: {a.kind}: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
