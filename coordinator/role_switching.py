"""Role switching at the coordinator: a worker drains, then comes back as another role. Pure: no sockets, no clock.

A switch starts from an operator's SWITCH_ROLE (`mserve switch-role`) or, with `--role-switching`,
from the policy (coordinator/role_policy.py) on a tick. Its phases, as `mserve status` shows them:

1. ``draining``: the coordinator sends the worker SWITCH_ROLE and routes it nothing new from that
   moment (Membership.routable leaves switching workers out, before the worker's own load says
   `draining`). Once nothing of the coordinator's depends on it, it gets SHUTDOWN, as any draining
   worker does (coordinator/drain.py): every stage it holds finishes there, nothing is re-run.
2. ``reloading``: the worker said BYE with `switching_to`; the coordinator takes it for gone (nothing
   depends on it) while it loads what the new role needs.
3. done: it registers again (READY, same worker id) with the new role and takes work.

A worker that dies mid-switch (kill -9: its heartbeats stop) is a dead worker like any other: what it
still held is re-run elsewhere (Lifecycle.worker_died) and the switch is dropped. So is one that said
BYE to switch and has not come back within `RELOAD_TIMEOUT_S`, or came back with another role.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mserve.common.protocol.to_worker import SWITCHABLE_ROLES, SwitchRole
from mserve.coordinator.membership import Membership
from mserve.coordinator.records import Outbox, RequestTable, Stage
from mserve.coordinator.role_policy import Decision, RoleMemory, RolePolicy, decide, keeps_serving

log = logging.getLogger("mserve.coordinator")

RELOAD_TIMEOUT_S = 300.0  # a worker that left to switch and is not back by then is taken for lost


@dataclass
class Switch:
    from_role: str
    to_role: str
    started: float
    reason: str
    reloading_since: float | None = None  # it said BYE to switch

    @property
    def phase(self) -> str:
        return "draining" if self.reloading_since is None else "reloading"


class RoleSwitcher:
    def __init__(self, members: Membership, requests: RequestTable, outbox: Outbox, auto: bool = False,
                 policy: RolePolicy = RolePolicy()) -> None:
        self.members, self.requests, self.outbox = members, requests, outbox
        self.auto, self.policy = auto, policy
        self.memory = RoleMemory()
        self.done = 0  # switches completed (the worker came back with its new role)
        self.dropped = 0  # switches abandoned (the worker died, or came back otherwise)

    @property
    def switching(self) -> dict[str, Switch]:
        return self.members.switching

    def refusal(self, worker_id: str, role: str) -> str | None:
        """Why this switch cannot start now (a 400-style reason naming the field), or None."""
        w = self.members.get(worker_id)
        if role not in SWITCHABLE_ROLES:
            return f"role {role!r}: a worker switches to one of {', '.join(SWITCHABLE_ROLES)}"
        if w is None:
            return f"worker_id {worker_id!r}: no such worker"
        if not w.alive:
            return f"worker_id {worker_id!r}: the worker is not alive"
        if w.role not in SWITCHABLE_ROLES:
            return f"worker_id {worker_id!r}: an {w.role} worker holds the vision tower only and does not switch"
        if w.role == role:
            return f"role {role!r}: worker {worker_id!r} already has that role"
        if worker_id in self.switching:
            return f"worker_id {worker_id!r}: already switching to {self.switching[worker_id].to_role}"
        if self.members.is_draining(worker_id):
            return f"worker_id {worker_id!r}: the worker is draining (it is leaving)"
        left: dict[str, int] = {}
        for v in self.members.routable():
            if v.worker_id != worker_id:
                left[v.role] = left.get(v.role, 0) + 1
        if not keeps_serving(left):
            return (f"worker_id {worker_id!r}: the last {w.role} worker of a pipeline with no other way to serve "
                    "(a prefill and a decode worker, or a unified one, must stay)")
        return None

    def start(self, worker_id: str, role: str, reason: str) -> None:
        """Begin a switch `refusal` allowed: routed nothing new from now; SWITCH_ROLE to the worker."""
        w = self.members.get(worker_id)
        assert w is not None
        self.switching[worker_id] = Switch(w.role, role, self.outbox.now, reason)
        log.info("worker %s switches role %s -> %s (%s): draining first", worker_id, w.role, role, reason)
        self.outbox.to_worker(worker_id, SwitchRole(worker_id=worker_id, role=role))

    def on_bye(self, worker_id: str, switching_to: str | None) -> None:
        sw = self.switching.get(worker_id)
        if sw is not None and switching_to == sw.to_role:
            sw.reloading_since = self.outbox.now
            log.info("worker %s drained and left to reload as %s", worker_id, sw.to_role)

    def on_join(self, worker_id: str, role: str) -> None:
        sw = self.switching.pop(worker_id, None)
        if sw is None:
            return
        if role == sw.to_role and sw.reloading_since is not None:
            self.done += 1
            log.info("worker %s switched role %s -> %s in %.1fs", worker_id, sw.from_role, role,
                     self.outbox.now - sw.started)
        else:
            self.dropped += 1
            log.warning("worker %s came back as %s, not %s: its switch is dropped", worker_id, role, sw.to_role)

    def tick(self) -> None:
        now = self.outbox.now
        for worker_id, sw in list(self.switching.items()):
            w = self.members.get(worker_id)
            if w is None or w.alive:
                continue
            if sw.reloading_since is None or now - sw.reloading_since > RELOAD_TIMEOUT_S:
                del self.switching[worker_id]
                self.dropped += 1
                log.warning("worker %s died while switching to %s (%s): switch dropped; what it held is re-run",
                            worker_id, sw.to_role, sw.phase)
        if not self.auto:
            return
        decision, self.memory = decide(self.members.routable(), *self._queued(), len(self.switching), self.memory,
                                       now, self.policy)
        if decision is not None:
            self._act(decision)

    def _queued(self) -> tuple[int, int]:
        """(prompt tokens waiting at the coordinator for a prefill, requests waiting for a decode)."""
        tokens = decodes = 0
        for st in self.requests.values():
            if st.stage != Stage.QUEUED:
                continue
            if st.next_stage in (Stage.START, Stage.ENCODE, Stage.PREFILL):
                tokens += len(st.admitted.prompt_ids)
            elif st.next_stage == Stage.DECODE:
                decodes += 1
        return tokens, decodes

    def _act(self, decision: Decision) -> None:
        why = self.refusal(decision.worker_id, decision.role)
        if why is not None:  # the policy's own guard should have kept it from asking
            log.warning("role switching: %s", why)
            return
        self.start(decision.worker_id, decision.role, f"auto: {decision.reason}")

    def status(self) -> dict[str, Any]:
        now = self.outbox.now
        return {"auto": self.auto, "completed": self.done, "dropped": self.dropped,
                "switching": {wid: {"from": sw.from_role, "to": sw.to_role, "phase": sw.phase,
                                    "for_s": round(now - sw.started, 1), "reason": sw.reason}
                              for wid, sw in sorted(self.switching.items())}}
