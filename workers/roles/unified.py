"""Unified role: encode, prefill and decode in one process; the monolithic baseline and smallest deployment."""

from __future__ import annotations

from mserve.common.protocol.to_worker import RunTask
from mserve.workers.requests import WorkerRequest
from mserve.workers.roles.encode import visual_input
from mserve.workers.roles.stepping import SteppingWorker
from mserve.workers.sequence import SamplingParams, Sequence


class UnifiedWorker(SteppingWorker):
    ROLE = "unified"

    def add(self, task: RunTask, rec: WorkerRequest) -> Sequence:
        return self.engine.add_request(task.request_id, task.prompt_ids,
                                       images=[visual_input(im) for im in task.images],
                                       sampling=SamplingParams.from_wire(task.sampling), priority=task.priority,
                                       output_ids=task.output_ids, latency_class=task.latency_class)
