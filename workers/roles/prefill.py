"""Prefill role: embeddings in, prompt through the language model, first token out, KV handed to decode."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from mserve.common.protocol.to_coordinator import Prefilled
from mserve.common.protocol.to_worker import AdoptBlocks, EmbeddingPart, Embeddings, PrefillTask
from mserve.workers.engine import StepOutput
from mserve.workers.fetcher import FetchJob
from mserve.workers.model_runner import EncodedImage
from mserve.workers.requests import WorkerRequest
from mserve.workers.roles.stepping import SteppingWorker, Timed
from mserve.workers.sequence import SamplingParams, Sequence

log = logging.getLogger("mserve.worker")


class PrefillWorker(SteppingWorker):
    ROLE = "prefill"
    PARTS = "text"

    def start(self, task: PrefillTask | AdoptBlocks | Embeddings) -> None:
        if isinstance(task, AdoptBlocks):
            return self.adopt(task)
        if isinstance(task, Embeddings):
            return self.more_embeddings(task)
        super().start(task)

    def more_embeddings(self, task: Embeddings) -> None:
        """Images that finished encoding after the request's PREFILL came: its prompt can go on."""
        rid = task.request_id
        rec = self.requests.get(rid, task.attempt)
        if rec is None:
            return  # an attempt no longer here (cancelled, re-run, failed): nothing waits for them

        def attach(got: list[Timed]) -> None:
            def attach_all() -> None:
                for i, enc in fetched_parts(rec, task.parts, got).items():
                    self.engine.attach_embeddings(rid, i, enc)

            self.guarded(rid, task.attempt, attach_all)  # a failure ends the attempt (its blocks too)

        # Queued behind the PREFILL's own fetch when that is still in flight (workers/fetcher.py).
        self.submit_fetch(rid, task.attempt, lambda: [self.fetch(p.descriptor) for p in task.parts], attach)

    def adopt(self, task: AdoptBlocks) -> None:
        """A decode worker's reply blocks, handed back: keep them cached for the conversation's next turn."""
        def adopt(kv: torch.Tensor) -> None:
            try:
                n = self.engine.adopt_blocks(task.token_ids, task.images, task.first_block, kv)
            except Exception as exc:  # only a later cache hit is at stake
                log.warning("%s: handed-back KV blocks not adopted: %s", task.request_id, exc)
                return
            log.debug("%s: adopted %d handed-back KV blocks", task.request_id, n)

        def failed(exc: BaseException) -> None:
            log.warning("%s: handed-back KV blocks not adopted: %s", task.request_id, exc)

        pull = lambda: self.transfer.fetch(task.descriptor, timeout_s=self.s.fetch_timeout_s)["kv"]  # noqa: E731
        self.fetches.submit(FetchJob(("adopt", task.request_id), pull, adopt, failed))

    def transfers(self, task: PrefillTask) -> Callable[[], Any] | None:
        return prompt_transfers(self, task)

    def add(self, task: PrefillTask, rec: WorkerRequest, fetched: list[Timed] | None) -> Sequence:
        return add_prompt(self, task, rec, fetched, prefill_only=True)

    def report(self, outputs: list[StepOutput]) -> None:
        for out in outputs:  # a prefill's one output ends its stage here
            rec = self.requests.get(out.request_id)
            if rec is not None:
                self.count_tokens(len(out.new_token_ids))
                self._send_prefilled(rec, out)
                self.end(rec.request_id)

    def _send_prefilled(self, rec: WorkerRequest, out: StepOutput) -> None:
        rid, attempt = rec.request_id, rec.attempt
        msg = Prefilled(request_id=rid, attempt=attempt, token_id=out.new_token_ids[0],
                        finish_reason=out.finish_reason or "stop", fetch_s=rec.take_fetch_s() or 0.0,
                        cached_tokens=rec.cached_tokens, worker_s=rec.worker_s(),
                        skipped_images=len(rec.seq.deferred) if rec.seq is not None else 0)
        if out.finish_reason == "prefilled":
            # The KV blocks are gathered straight into the transfer's buffer (a pooled shm
            # segment for shm/auto): publishing then copies nothing.
            allocs = []

            def alloc(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
                allocs.append(self.transfer.alloc(spec))
                return allocs[-1].tensors

            try:
                export = self.engine.export_kv(rid, alloc=alloc)
                msg.descriptor = self.transfer.publish_allocated(f"{rid}:{attempt}:kv", allocs[0]).to_wire()
            finally:
                for a in allocs:
                    a.free()  # a no-op once published
            msg.state = export.state
        self.send(msg)


def prompt_transfers(worker: SteppingWorker, task: PrefillTask) -> Callable[[], Any] | None:
    """A PREFILL's embeddings to fetch from the encode workers (none: text only, or all skipped)."""
    if task.embeddings:
        return lambda: [worker.fetch(task.embeddings)]
    if task.embedding_parts:
        return lambda: [worker.fetch(p.descriptor) for p in task.embedding_parts]
    return None


def fetched_parts(rec: WorkerRequest, parts: list[EmbeddingPart], got: list[Timed],
                  grids: list | None = None) -> dict[int, EncodedImage]:
    """Each part's fetched embeddings, as {image index: EncodedImage}."""
    out = {}
    for part, fetched in zip(parts, got):
        tensors = fetched.note(rec)
        for j, i in enumerate(part.images):
            grid = (part.grids or [None] * len(part.images))[j] or (grids[i] if grids else None)
            out[i] = EncodedImage(tensors[f"img{j}"], tuple(grid) if grid else None)
    return out


def add_prompt(worker: SteppingWorker, task: PrefillTask, rec: WorkerRequest, fetched: list[Timed] | None,
               prefill_only: bool) -> Sequence:
    """A PREFILL's prompt into the worker's engine, with its fetched embeddings. `prefill_only`: it leaves
    after its first token (a prefill worker); else it decodes on (a decode worker lent the prompt)."""
    rid = task.request_id
    encoded: list[EncodedImage | None] = []
    if task.embeddings:
        tensors = fetched[0].note(rec)
        grids = task.grids or [None] * len(tensors)
        encoded = [EncodedImage(tensors[f"img{i}"], tuple(grids[i]) if grids[i] else None)
                   for i in range(len(tensors))]
    elif task.embedding_parts or task.pending_images:
        # Encoded on several encoders: the parts in so far; the pending ones follow as EMBEDDINGS.
        got = fetched_parts(rec, task.embedding_parts or [], fetched or [], task.grids)
        encoded = [got.get(i) for i in range(len(task.image_hashes))]
    elif task.skipped_images:
        encoded = [None] * len(task.image_hashes)
    # Skipped images come from nowhere: should this pool lack their prefix blocks after all, the
    # engine drops the request and the worker reports it (stepping.py) for a re-run that encodes them.
    deferred = {i: None for i in task.skipped_images}
    return worker.engine.add_request(rid, task.prompt_ids, encoded=encoded, image_hashes=task.image_hashes or None,
                                     deferred=deferred, grids=task.grids,
                                     sampling=SamplingParams.from_wire(task.sampling), priority=task.priority,
                                     prefill_only=prefill_only, output_ids=task.output_ids,
                                     latency_class=task.latency_class, item_tokens=task.image_tokens or None,
                                     item_fps=task.item_fps)
