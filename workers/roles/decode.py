"""Decode role: adopt a prefilled request's KV blocks into this pool and decode it in the continuous batch.

A PREFILL the coordinator lends a decode worker (its local_prefill_tokens: the prefill pool is behind)
is prefilled here from the encoders' embeddings, like a prefill worker would, and decodes on in the
same batch: nothing is handed over."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from mserve.common.protocol.to_coordinator import TokenItem
from mserve.common.protocol.to_worker import DecodeTask, PrefillTask
from mserve.common.transfer import TransferError
from mserve.workers.engine import StepOutput
from mserve.workers.hand_back import KVExport
from mserve.workers.requests import WorkerRequest
from mserve.workers.roles.prefill import add_prompt, prompt_transfers
from mserve.workers.roles.stepping import SteppingWorker, Timed
from mserve.workers.sequence import Sequence

log = logging.getLogger("mserve.worker")


class DecodeWorker(SteppingWorker):
    ROLE = "decode"
    PARTS = "text"

    def transfers(self, task: DecodeTask | PrefillTask) -> Callable[[], Any] | None:
        if isinstance(task, PrefillTask):
            return prompt_transfers(self, task)

        def pull() -> Timed:
            t0 = time.perf_counter()
            # Zero-copy: over shm the tensors are views of the prefill worker's segment and
            # import_kv's copy into this pool is the only copy on this side.
            view = self.transfer.fetch_view(task.descriptor, timeout_s=self.s.fetch_timeout_s)
            return Timed(view, time.perf_counter() - t0, time.time_ns(), "kv.transfer")

        return pull

    def release_fetched(self, fetched: Timed | list[Timed]) -> None:
        if isinstance(fetched, Timed):  # a PREFILL's embeddings are copies: nothing to ack
            fetched.value.release()  # the request left while its KV came: ack, so the sender reuses the segment

    def add(self, task: DecodeTask | PrefillTask, rec: WorkerRequest, fetched: Any) -> Sequence:
        if isinstance(task, PrefillTask):
            return add_prompt(self, task, rec, fetched, prefill_only=False)
        rid = task.request_id
        view = fetched.note(rec)
        # Leaving the block releases the view: the ack that lets the sender reuse the segment.
        with view as tensors:
            # The request keeps its prompt inputs for its lifetime (recompute after preemption),
            # so those must not stay views; they are small next to the KV.
            keep = (lambda t: t.clone()) if view.zero_copy else (lambda t: t)
            mrope = tensors.get("mrope")
            export = KVExport(task.state, tensors["kv"], keep(mrope) if mrope is not None else None,
                              [keep(tensors[f"emb{i}"]) if f"emb{i}" in tensors else None  # None: skipped by a prefix hit
                               for i in range(len(task.state.images))],
                              # the linear-attention state: import_kv copies it into its own tensors
                              [tensors[f"lin{j}"] for j in range(sum(k.startswith("lin") for k in tensors))])
            seq = self.engine.import_kv(export, request_id=rid)
        seq.hand_back = task.hand_back
        return seq

    def finishing(self, rec: WorkerRequest, item: TokenItem, out: StepOutput) -> None:
        """With --kv-hand-back: publish the reply's full KV blocks for the prefill worker (workers/hand_back.py)."""
        blocks, rid = out.hand_back, rec.request_id
        if blocks is None:
            return
        try:
            desc = self.transfer.publish(f"{rid}:{rec.attempt}:handback", {"kv": blocks.kv})
        except TransferError as exc:  # the reply is delivered either way; only the next turn's hit is lost
            log.warning("%s: KV hand-back not published: %s", rid, exc)
            return
        item.hand_back = blocks.to_wire(desc.to_wire())
