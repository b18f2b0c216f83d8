"""Unified role: encode, prefill and decode in one process; the monolithic baseline and smallest deployment.

Like an encode worker it reads the embedding tiers (workers/embedding_tiers.py) before encoding, and its
engine skips images the cached prefix already holds (workers/prefix_skip.py)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mserve.common.protocol.to_coordinator import TokenItem
from mserve.common.protocol.to_worker import RunTask
from mserve.common.video import visual_hash
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

    def transfers(self, task: RunTask) -> Callable[[], dict[str, Any]] | None:
        """The images not in L1, decoded and run through the image processor on an IO thread
        (workers/fetcher.py) while the loop steps: the model's thread then only runs the vision forward."""
        limit = self.s.max_image_bytes
        todo = [visual_input(im) for im in task.images if not self.tiers.in_memory(im.hash)
                and all(len(d or b"") <= limit for d in (im.frames or [im.data]))]  # over: refused on the loop
        if not todo:
            return None
        runner = self.engine.runner

        def decode() -> dict[str, Any]:
            out = {}
            for item in todo:
                try:
                    decoded = self.engine.decode_visual(item)
                    # a video's frames and an audio clip's waveform go to the tower as they are
                    out[visual_hash(item)] = decoded if isinstance(decoded, (list, np.ndarray)) \
                        else runner.prepare_image(decoded)
                except Exception:  # decoded again at admission, which fails the request as it always did
                    pass
            return out

        return decode

    def add(self, task: RunTask, rec: WorkerRequest, fetched: dict[str, Any] | None) -> Sequence:
        self.engine.predecoded.update(fetched or {})
        try:
            return self.engine.add_request(task.request_id, task.prompt_ids,
                                           images=[visual_input(im) for im in task.images],
                                           sampling=SamplingParams.from_wire(task.sampling), priority=task.priority,
                                           output_ids=task.output_ids, latency_class=task.latency_class)
        finally:
            for h in fetched or ():  # those a cache or the prefix made unnecessary
                self.engine.predecoded.pop(h, None)

    def finishing(self, rec: WorkerRequest, item: TokenItem, out: StepOutput) -> None:
        if rec.seq is not None:  # what the caches saved this request, for its RESULT
            item.skipped_images, item.embedding_hits = len(rec.seq.deferred), rec.seq.embedding_hits

    def republish_indexes(self) -> int:
        return self.tiers.republish() + super().republish_indexes()

    def drop_indexes(self) -> None:
        super().drop_indexes()
        self.tiers.drop()
