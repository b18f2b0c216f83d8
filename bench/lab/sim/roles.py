"""Role switching in the scale model: the coordinator's own policy, and a switch as the real one goes.

On every housekeeping tick (0.25 s; the real coordinator asks on each loop pass) the cluster asks
coordinator/role_policy.py's `decide` itself, over the coordinator's routing views. A switch then
goes as coordinator/role_switching.py and workers/switching.py run it: the worker is routed nothing
new from that moment, finishes every stage it holds (drained: the coordinator's count of stages open
on it is zero), then is gone for `reload_s` while it builds its new role's engine and loads the
weights again, and registers back under the same id in its new role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab.sim.workers import DecodeWorker, PrefillWorker
from mserve.coordinator.role_policy import RoleMemory, RolePolicy, decide
from mserve.coordinator.routing import WorkerView

if TYPE_CHECKING:
    from lab.sim.cluster import Cluster

# The reload, a stated estimate: what the small-llava takes to load and run its first prefill on a
# quiet host, 2.8 s (bench/lab/NOTEBOOK.md, the compile-cache notes), rounded up. The drain is simulated.
RELOAD_S = 3.0

ROLE_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker}


class RoleSwitching:
    def __init__(self, cl: Cluster, policy: RolePolicy, reload_s: float = RELOAD_S) -> None:
        assert cl.coordinators == 1, "role switching is modelled with one coordinator"
        self.cl, self.policy, self.reload_s = cl, policy, reload_s
        self.memory = RoleMemory()
        self.draining: dict[str, str] = {}  # worker id -> the role it comes back as
        self.reloading: set[str] = set()
        self.switches: list[tuple[float, str, str]] = []  # (started at, worker id, new role)

    @property
    def coord(self):
        return self.cl.coords[0]

    def tick(self, now: float) -> None:
        for wid, role in list(self.draining.items()):
            if self.coord.views[wid].inflight == 0:  # nothing of the coordinator's open on it: SHUTDOWN, BYE
                del self.draining[wid]
                self.reloading.add(wid)
                self.cl.loop.after(self.reload_s, self._rejoin, wid, role)
        gone = self.draining.keys() | self.reloading
        routable = [v for v in self.coord.views.values() if v.worker_id not in gone]
        decision, self.memory = decide(routable, 0, 0, len(gone), self.memory, now, self.policy)
        if decision is not None:
            self._start(decision.worker_id, decision.role, now)

    def _start(self, wid: str, role: str, now: float) -> None:
        v = self.coord.views[wid]
        self.coord.by_role[v.role].remove(v)  # Membership.routable leaves it out from now
        self.draining[wid] = role
        self.switches.append((now, wid, role))

    def _rejoin(self, wid: str, role: str) -> None:
        """READY again, same id, new role: a fresh engine and an empty KV pool."""
        self.reloading.discard(wid)
        worker = ROLE_CLASSES[role](self.cl, wid)
        self.cl.workers[self.cl.workers.index(self.cl.worker[wid])] = worker
        self.cl.worker[wid] = worker
        view = WorkerView(wid, role)
        self.coord.views[wid] = view
        self.coord.by_role.setdefault(role, []).append(view)
