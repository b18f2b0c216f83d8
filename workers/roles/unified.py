"""Unified role: encode, prefill and decode in one process; the monolithic baseline and smallest deployment.

Like an encode worker it reads the embedding tiers (workers/embedding_tiers.py) before encoding, and its
engine skips images the cached prefix already holds (workers/prefix_skip.py)."""

from __future__ import annotations

from typing import Any

from mserve.common.protocol.to_coordinator import TokenItem
from mserve.common.protocol.to_worker import RunTask
from mserve.workers.embedding_tiers import embedding_tiers
from mserve.workers.engine import StepOutput
from mserve.workers.requests import WorkerRequest
from mserve.workers.roles.encode import visual_input
from mserve.workers.roles.stepping import SteppingWorker
from mserve.workers.sequence import SamplingParams, Sequence


class UnifiedWorker(SteppingWorker):
    ROLE = "unified"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine.tiers = self.tiers = embedding_tiers(self)

    def add(self, task: RunTask, rec: WorkerRequest, fetched: None) -> Sequence:
        return self.engine.add_request(task.request_id, task.prompt_ids,
                                       images=[visual_input(im) for im in task.images],
                                       sampling=SamplingParams.from_wire(task.sampling), priority=task.priority,
                                       output_ids=task.output_ids, latency_class=task.latency_class)

    def finishing(self, rec: WorkerRequest, item: TokenItem, out: StepOutput) -> None:
        if rec.seq is not None:  # what the caches saved this request, for its RESULT
            item.skipped_images, item.embedding_hits = len(rec.seq.deferred), rec.seq.embedding_hits

    def republish_indexes(self) -> int:
        return self.tiers.republish() + super().republish_indexes()

    def drop_indexes(self) -> None:
        super().drop_indexes()
        self.tiers.drop()
