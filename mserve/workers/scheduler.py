"""Decides, each engine step, which requests run and how many of their tokens: pure Python, no torch.

One token budget per step covers decode tokens (one per running request) and prefill chunks
(prompts longer than what is left of the budget are prefilled over several steps). Requests are
admitted only when the pool can hold their whole prompt; when a running request cannot grow, the
lowest-priority, latest request is preempted (its blocks freed, its tokens recomputed later).
"""

from __future__ import annotations

from dataclasses import dataclass

from mserve.workers.block_pool import BlockPool, OutOfBlocks
from mserve.workers.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so the step samples a new one."""
        return self.end == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        capacity = self.pool.num_blocks * self.pool.block_size
        # A prefill-only request needs room for its prompt and first token; others for every token.
        needed = seq.num_tokens + (1 if seq.prefill_only else seq.sampling.max_tokens - len(seq.output_ids))
        if needed > capacity:
            raise ValueError(
                f"request {seq.request_id}: prompt ({seq.num_tokens} tokens) + "
                f"{'1' if seq.prefill_only else f'max_tokens ({seq.sampling.max_tokens})'} "
                f"exceeds the KV pool capacity of {capacity} tokens"
            )
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=Sequence.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a request whose blocks are already allocated and filled (imported KV)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = seq.finish_reason or reason
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def release_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        self.running.sort(key=Sequence.sort_key)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n):
                preempted = True
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if not preempted:
            budget = self._admit_waiting(chunks, budget)
        return chunks

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s table cover `num_tokens`, preempting later requests if needed."""
        while True:
            try:
                self.pool.allocate(seq.block_table, num_tokens)
                return True
            except OutOfBlocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=Sequence.sort_key)

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            bs = self.pool.block_size
            hashes = seq.prompt_hashes(bs) if self.enable_prefix_caching else []
            usable = (seq.num_tokens - 1) // bs
            hit_ids = self.pool.match_prefix(hashes[:usable], seq.token_ids) if hashes else []
            hits = len(hit_ids)
            # Admit only when the whole (remaining) prompt fits: a half-prefilled request that
            # must be preempted wastes the work already done. Cached hits that sit in the free
            # list are taken out of it too, so they count against the free blocks.
            needed = self.pool.blocks_needed(seq.num_tokens) - hits
            free_hits = sum(1 for b in hit_ids if self.pool.blocks[b].ref_count == 0)
            if not self.pool.can_allocate(needed + free_hits):
                break
            n = min(seq.num_tokens - hits * bs, budget)
            cached = self.pool.allocate(seq.block_table, hits * bs + n, hashes, seq.token_ids)
            assert cached == hits * bs
            seq.num_computed_tokens = cached
            seq.num_cached_tokens = cached
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, cached, n))
            budget -= n
        return budget
