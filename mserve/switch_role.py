"""`mserve switch-role WORKER_ID ROLE`: ask the coordinator to move one worker to another role.

The worker drains first (no new work, what it holds finishes), then reloads as ROLE under the same id
and registers again (docs/architecture.md, "Role switching"). With --wait, this command returns once the
coordinator sees it back with its new role. Only the stdlib at module level: `mserve --help` builds
this module's parser.
"""

from __future__ import annotations

import argparse
import sys
import time

SWITCHABLE = ("prefill", "decode", "unified")  # common/protocol/to_worker.py SWITCHABLE_ROLES (test_switch_role checks)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mserve.status import DEFAULT_COORDINATOR

    p.add_argument("worker_id", help="the worker to switch, as `mserve status` lists it")
    p.add_argument("role", choices=SWITCHABLE, help="its new role")
    p.add_argument("--coordinator", default=DEFAULT_COORDINATOR, metavar="ADDR",
                   help="the coordinator's client address, what its --bind is (default %(default)s)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the worker to be back with its new role (default 0: return once "
                        "the switch has started)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for the coordinator's answer (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    """0 once the switch started (with --wait: finished); 1 when refused, unanswered, or not back in time."""
    from mserve.coordinator.client import Client, MServeError

    try:
        with Client(args.coordinator, timeout_s=args.timeout) as client:
            status = client.switch_role(args.worker_id, args.role)
            print(f"worker {args.worker_id}: switching to {args.role} "
                  f"({status['workers'].get(args.worker_id, {}).get('switching', 'started')})")
            deadline = time.monotonic() + args.wait
            while args.wait > 0:
                w = client.status()["workers"].get(args.worker_id, {})
                if w.get("alive") and w.get("role") == args.role and not w.get("switching"):
                    print(f"worker {args.worker_id}: serving as {args.role}")
                    break
                if time.monotonic() > deadline:
                    print(f"worker {args.worker_id}: not back as {args.role} within {args.wait:g}s", file=sys.stderr)
                    return 1
                time.sleep(0.2)
    except MServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
