"""A worker process across role switches: run a worker; when it left to switch, run it again as the new role.

SWITCH_ROLE (from the coordinator: an operator's `mserve switch-role`, or its `--role-switching` policy)
makes the worker drain exactly as on SIGTERM (workers/draining.py): no new work is routed to it, what
it holds finishes, every tensor it published is fetched, the coordinator releases it. Its loop then
ends, it says BYE with `switching_to`, and closes its sockets, transfer engine and Redis lane. `serve`
drops it and builds the worker of the new role from the same settings and worker id: the engine and
pool are sized for that role and the checkpoint's weights loaded again (prefill, decode and unified
workers all hold the text model; a unified one the vision tower too). It registers (READY) with the
new role and takes work. Encode workers, which hold only the vision tower, do not switch.
"""

from __future__ import annotations

import gc
import logging

from mserve.workers.settings import WorkerSettings
from mserve.workers.worker import make_worker

log = logging.getLogger("mserve.worker")


def serve(settings: WorkerSettings) -> None:
    """Run a worker of `settings.role` until it stops; after each role switch, again as its new role."""
    while True:
        worker = make_worker(settings)
        worker.run()
        role, worker_id, old = worker.switch_to, worker.worker_id, worker.role
        if role is None:
            return
        del worker
        gc.unfreeze()  # the start-up heap frozen at run(): the old role's engine must be collectable
        gc.collect()
        log.info("worker %s: drained as %s, loading as %s", worker_id, old, role)
        settings = settings.model_copy(update={"role": role, "worker_id": worker_id})
