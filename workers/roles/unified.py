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
from mserve.workers.roles.encode import pulled_input, visual_input
from mserve.workers.roles.stepping import SteppingWorker
from mserve.workers.sequence import SamplingParams, Sequence


class UnifiedWorker(SteppingWorker):
    ROLE = "unified"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine.tiers = self.tiers = embedding_tiers(self)

    def transfers(self, task: RunTask) -> Callable[[], dict[str, Any]] | None:
        """On an IO thread (workers/fetcher.py) while the loop steps: the items in a media store pulled
        from it (common/media_store.py), and the images not in L1 decoded and run through the image
        processor: the model's thread then only runs the vision forward."""
        limit = self.s.max_image_bytes
        stored = {i: im for i, im in enumerate(task.images) if im.media is not None}
        inline = [visual_input(im) for im in task.images if im.media is None and not self.tiers.in_memory(im.hash)
                  and all(len(d or b"") <= limit for d in (im.frames or [im.data]))]  # over: refused on the loop
        if not inline and not stored:
            return None
        runner, timeout_s = self.engine.runner, self.s.fetch_timeout_s

        def pull_and_decode() -> dict[str, Any]:
            pulled = {i: pulled_input(self.transfer, im, timeout_s) for i, im in stored.items()}  # MediaError fails it
            decoded = {}
            for item in inline + [pulled[i] for i, im in stored.items() if not self.tiers.in_memory(im.hash)]:
                try:
                    out = self.engine.decode_visual(item)
                    # a video's frames and an audio clip's waveform go to the tower as they are
                    decoded[visual_hash(item)] = out if isinstance(out, (list, np.ndarray)) else runner.prepare_image(out)
                except Exception:  # decoded again at admission, which fails the request as it always did
                    pass
            return {"decoded": decoded, "pulled": pulled}

        return pull_and_decode

    def add(self, task: RunTask, rec: WorkerRequest, fetched: dict[str, Any] | None) -> Sequence:
        decoded, pulled = (fetched or {}).get("decoded", {}), (fetched or {}).get("pulled", {})
        self.engine.predecoded.update(decoded)
        try:
            return self.engine.add_request(task.request_id, task.prompt_ids,
                                           images=[pulled[i] if im.media is not None else visual_input(im)
                                                   for i, im in enumerate(task.images)],
                                           sampling=SamplingParams.from_wire(task.sampling), priority=task.priority,
                                           output_ids=task.output_ids, latency_class=task.latency_class)
        finally:
            for h in decoded:  # those a cache or the prefix made unnecessary
                self.engine.predecoded.pop(h, None)

    def finishing(self, rec: WorkerRequest, item: TokenItem, out: StepOutput) -> None:
        if rec.seq is not None:  # what the caches saved this request, for its RESULT
            item.skipped_images, item.embedding_hits = len(rec.seq.deferred), rec.seq.embedding_hits

    def republish_indexes(self) -> int:
        return self.tiers.republish() + super().republish_indexes()

    def drop_indexes(self) -> None:
        super().drop_indexes()
        self.tiers.drop()
