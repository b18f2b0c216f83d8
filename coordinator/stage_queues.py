"""Requests waiting at the coordinator for a worker, one queue per stage, served in class order. Pure code.

A request waits here between stages: for a pipeline (START, no pool it needs is up), or for a worker
of its next stage's role that is up and under the coordinator's `max_stages_per_worker`. The request
machine (coordinator/requests.py) binds the best waiting request of a stage to whichever worker
frees first. Best: the class order (common/policy.py: higher `priority`, then `interactive` before
`batch`), then the earliest to start waiting (FIFO). Nothing starves: one that has waited longer
than `aging_s` ranks above every class, among the aged by when they started waiting. Ties break by
push order, so the order is deterministic.
A pop scans its stage's queue (O(waiting), which max_waiting_requests bounds).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

from mserve.common.policy import CLASS_AGING_S, aged_class_rank, class_rank
from mserve.coordinator.records import STAGE_ROLE, Stage
from mserve.coordinator.routing import WorkerView


def class_name(priority: int, latency_class: str) -> str:
    """How status shows a class: "interactive", "batch", or with a priority other than 0 "batch/p2"."""
    return latency_class if priority == 0 else f"{latency_class}/p{priority}"


def takers(workers: Iterable[WorkerView], stage: Stage, cap: int) -> list[WorkerView]:
    """The live workers of `stage`'s role with fewer than `cap` stages open (the coordinator's
    max_stages_per_worker; 0: no cap). Decode is never capped: a decode worker batches whatever fits
    its KV pool, and route_decode weighs that."""
    cap = 0 if stage == Stage.DECODE else cap
    role = STAGE_ROLE.get(stage)
    return [w for w in workers if w.alive and w.role == role and (cap <= 0 or w.inflight < cap)]


@dataclass(frozen=True)
class Waiting:
    rid: str
    stage: Stage
    priority: int
    latency_class: str
    since: float  # when it started waiting (FIFO order, aging, and the request's queue_s)
    seq: int  # push order: the last tie-break

    def rank(self, now: float, aging_s: float) -> tuple:
        """Smaller is served first."""
        return (*aged_class_rank(self.priority, self.latency_class, now - self.since, aging_s), self.since, self.seq)


class StageQueues:
    def __init__(self, aging_s: float = CLASS_AGING_S) -> None:
        self.aging_s = aging_s
        self._by_stage: dict[Stage, dict[str, Waiting]] = {}
        self._stage_of: dict[str, Stage] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._stage_of)

    def __contains__(self, rid: str) -> bool:
        return rid in self._stage_of

    def push(self, rid: str, stage: Stage, *, priority: int, latency_class: str, since: float) -> None:
        """Wait at `stage`. Already waiting there: it keeps its place; at another stage: it moves."""
        if self._stage_of.get(rid) == stage:
            return
        self.discard(rid)
        self._by_stage.setdefault(stage, {})[rid] = Waiting(rid, stage, priority, latency_class, since,
                                                             next(self._seq))
        self._stage_of[rid] = stage

    def discard(self, rid: str) -> Waiting | None:
        """Stop waiting (dispatched, ended or re-run); its entry, or None if it was not waiting."""
        stage = self._stage_of.pop(rid, None)
        return None if stage is None else self._by_stage[stage].pop(rid)

    def first(self, stage: Stage, now: float) -> Waiting | None:
        """The request `stage` serves next at `now`, or None when none waits there."""
        waiting = self._by_stage.get(stage)
        return min(waiting.values(), key=lambda w: w.rank(now, self.aging_s)) if waiting else None

    def ordered(self, stage: Stage, now: float) -> list[Waiting]:
        """Everything waiting at `stage`, in the order it would be served at `now`."""
        return sorted(self._by_stage.get(stage, {}).values(), key=lambda w: w.rank(now, self.aging_s))

    def counts(self) -> dict[str, dict[str, int]]:
        """{stage: {class: requests}} for the stages where something waits (the STATUS reply's "queued")."""
        out: dict[str, dict[str, int]] = {}
        for stage in Stage:  # pipeline order; within a stage, best class first
            classes = sorted((*class_rank(w.priority, w.latency_class), class_name(w.priority, w.latency_class))
                             for w in self._by_stage.get(stage, {}).values())
            for *_, name in classes:
                per_class = out.setdefault(stage.value, {})
                per_class[name] = per_class.get(name, 0) + 1
        return out
