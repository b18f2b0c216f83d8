"""Decides, each engine step, which requests run and how many of their tokens: pure Python, no torch.

A step first gives every running request that is decoding its one token, then spends at most
`max_prefill_tokens` (the chunk cap) on prompts, so a stream never waits behind more than one
chunk. Prompts (new ones and half-prefilled ones alike) are served in policy order: higher
priority first, then the `interactive` latency class, then the fewest remaining prompt tokens,
where waiting counts as progress (`aging_tokens_per_s`) so a long prompt cannot starve; a prompt
queued longer than `class_aging_s` goes before every class (common/policy.py), so a `batch` one
cannot starve behind a steady stream of `interactive` ones either. A new
request is admitted only when the pool can hold its whole prompt plus the next tokens of every
running request and its own (up to `reserve_tokens` each): admitting more than the pool can carry
only turns into preemption and recompute, which at saturation becomes thrash. When a running
request still cannot grow, the lowest-priority, latest request is preempted (blocks freed, tokens
recomputed later).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mserve.common.policy import CLASS_AGING_S, DEFAULT_ENGINE, aged_class_rank, fits_kv
from mserve.workers.block_pool import BlockPool, OutOfBlocks
from mserve.workers.image_bounds import bidirectional_spans, chunk_end, usable_prefix_blocks
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
    def __init__(self, pool: BlockPool, *, max_num_seqs: int = DEFAULT_ENGINE.max_num_seqs,
                 max_num_batched_tokens: int = DEFAULT_ENGINE.max_num_batched_tokens,
                 max_prefill_tokens: int | None = None, aging_tokens_per_s: float = 1000.0,
                 reserve_tokens: int = DEFAULT_ENGINE.reserve_tokens, enable_prefix_caching: bool = True,
                 class_aging_s: float = CLASS_AGING_S,
                 clock: Callable[[], float] = time.monotonic, whole_images: bool = False,
                 causal_token: int | None = None,
                 release: Callable[[Sequence], None] | None = None,
                 snapshot: Callable[[Sequence, str], None] | None = None,
                 restore: Callable[[Sequence, str], None] | None = None) -> None:
        """`whole_images`: no chunk and no reused prefix ends inside an image (workers/image_bounds.py),
        for families whose image tokens attend to each other both ways; not the runs of `causal_token` (an audio
        clip's, which attend causally). `release`: called when a sequence's
        computed state is dropped (freed or preempted), for state kept outside the block pool (the model
        runner's linear-attention states, workers/linear_state.py). `snapshot(seq, block hash)`: called where a
        prompt chunk ends on a full block, to keep that state for later prefix hits, which `restore(seq, block
        hash)` resumes from (the pool then reuses prefixes only up to a block with a snapshot); with them, one
        chunk of every prompt ends at its last full block, so a repeated prompt always leaves a snapshot."""
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = min(max_prefill_tokens or max_num_batched_tokens, max_num_batched_tokens)
        assert self.max_prefill_tokens > 0
        self.aging_tokens_per_s = aging_tokens_per_s
        self.class_aging_s = class_aging_s
        self.reserve_tokens = reserve_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.whole_images = whole_images
        self.causal_token = causal_token
        self.release = release
        self.snapshot, self.restore = snapshot, restore
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Finished, but their KV blocks are still to be copied out (a prefill's to its decode worker,
        # a reply's hand-back): kept until `free`.
        self.handing_off: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        capacity = self.pool.num_blocks * self.pool.block_size
        # A prefill-only request needs room for its prompt and first token; others for every token.
        new_tokens = 1 if seq.prefill_only else seq.sampling.max_tokens - len(seq.output_ids)
        if not fits_kv(seq.num_tokens, new_tokens, self.pool.num_blocks, self.pool.block_size):
            raise ValueError(
                f"request {seq.request_id}: prompt ({seq.num_tokens} tokens) + "
                f"{'1' if seq.prefill_only else f'max_tokens ({seq.sampling.max_tokens})'} "
                f"exceeds the KV pool capacity of {capacity} tokens"
            )
        seq.status = SeqStatus.WAITING
        seq.queued_at = self.clock()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a request whose blocks are already allocated and filled (imported KV)."""
        seq.status = SeqStatus.RUNNING
        seq.queued_at = self.clock()
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

    def prefill_key(self, seq: Sequence, now: float) -> tuple[int, int, int, float, int]:
        """Serving order of prompts: priority and latency class (unless queued past `class_aging_s`), then
        remaining tokens less what waiting earned."""
        waited = max(0.0, now - seq.queued_at)
        aged = seq.num_uncomputed_tokens - self.aging_tokens_per_s * waited
        return (*aged_class_rank(seq.priority, seq.latency_class, waited, self.class_aging_s), aged, seq.arrival)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        self.running.sort(key=Sequence.sort_key)
        preempted = False
        for seq in list(self.running):  # decode: one token each
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if not self._grow_or_preempt(seq, seq.num_tokens):
                preempted = True
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            budget -= 1
        self._schedule_prompts(chunks, min(budget, self.max_prefill_tokens), admit=not preempted)
        return chunks

    def _schedule_prompts(self, chunks: list[ScheduledChunk], budget: int, admit: bool) -> None:
        """Half-prefilled and waiting prompts in policy order, until the chunk cap is spent."""
        now = self.clock()
        partial = [s for s in self.running if s.num_uncomputed_tokens > 1]
        candidates = partial + (self.waiting if admit else [])
        for seq in sorted(candidates, key=lambda s: self.prefill_key(s, now)):
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING:
                done = seq.num_computed_tokens
                n = self._chunk_size(seq, done, min(seq.ready_tokens() - done, budget))
                if n <= 0:
                    continue  # waiting for an image's embeddings; its blocks stay reserved
                if not self._grow_or_preempt(seq, seq.num_computed_tokens + n):
                    return  # the pool is exhausted: admit nothing new this step either
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
            elif seq.status is SeqStatus.WAITING and seq in self.waiting:
                if len(self.running) >= self.max_num_seqs:
                    continue
                n = self._admit(seq, budget)
                if n is None:
                    return  # keep the order: nothing jumps a prompt that is waiting for blocks
                if n > 0:  # 0: admitted (its blocks reserved), but its first image has not arrived yet
                    chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    budget -= n

    def _chunk_size(self, seq: Sequence, start: int, n: int) -> int:
        """`n` tokens from `start`, or as many as keep the chunk from ending inside an image (whole_images)."""
        if n > 0 and self.whole_images:
            n = chunk_end(self._whole(seq), start, start + n) - start
        if self.snapshot is not None and self.enable_prefix_caching:  # end one chunk at the last full block
            last_full = (len(seq.prompt_ids) - 1) // self.pool.block_size * self.pool.block_size  # a hit stops there
            if start < last_full < start + n:
                n = last_full - start
        return n

    def _whole(self, seq: Sequence) -> list:
        """The spans of `seq` no chunk and no reused prefix may end inside."""
        return bidirectional_spans(seq.images, seq.prompt_ids, self.causal_token)

    def _lookahead(self, seq: Sequence) -> int:
        """Tokens `seq` will still add, as far as admission plans ahead."""
        remaining = 1 if seq.prefill_only else seq.sampling.max_tokens - len(seq.output_ids)
        return max(0, min(remaining, self.reserve_tokens))

    def _reserved_for_running(self) -> int:
        """Blocks the running requests will need for their next tokens beyond what they hold."""
        need = 0
        for s in self.running:
            target = self.pool.blocks_needed(s.num_tokens + self._lookahead(s))
            need += max(0, target - len(s.block_table.block_ids))
        return need

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
        if self.release is not None:  # recompute from scratch: the state it had is dropped too
            self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Start prefilling `seq` (cached prefix blocks first); None when its prompt does not fit."""
        bs = self.pool.block_size
        hashes = seq.prompt_hashes(bs) if self.enable_prefix_caching else []
        hit_ids = self.pool.reusable_prefix(hashes, seq.token_ids, seq.num_tokens) if hashes else None
        if hit_ids and self.whole_images:
            hit_ids = hit_ids[:usable_prefix_blocks(self._whole(seq), len(hit_ids), bs)]
        hits = len(hit_ids or ())
        # Admit only when the whole (remaining) prompt fits: a half-prefilled request that
        # must be preempted wastes the work already done. Cached hits that sit in the free
        # list are taken out of it too, so they count against the free blocks.
        needed = self.pool.blocks_needed(seq.num_tokens + self._lookahead(seq)) - hits
        free_hits = self.pool.num_idle(hit_ids or ())
        if not self.pool.can_allocate(needed + free_hits + self._reserved_for_running()):
            return None
        n = self._chunk_size(seq, hits * bs, max(0, min(seq.ready_tokens(hits * bs) - hits * bs, budget)))
        cached = self.pool.allocate(seq.block_table, hits * bs + n, hit_ids)
        assert cached == hits * bs
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        if hits and self.restore is not None:  # the state outside the blocks, as it was after the last hit block
            self.restore(seq, hashes[hits - 1])
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return n

    # -- after the model ran -----------------------------------------------------------------------
    def postprocess(self, chunks: list[ScheduledChunk], token_ids: list[int]) -> list[Sequence]:
        """Record a step's progress: `token_ids` are the tokens sampled for the chunks that complete
        their sequence, in order. Each is appended; a sequence that meets a stop condition finishes
        and its blocks are freed, unless its KV still leaves this pool (`handing_off`). Returns the
        sequences that got a token, in the order of `token_ids`."""
        for c in chunks:
            c.seq.num_computed_tokens = c.end
            if self.enable_prefix_caching:  # full prompt blocks become findable by later requests
                self.pool.commit_full_blocks(c.seq.block_table, c.seq.prompt_ids,
                                             min(c.end, len(c.seq.prompt_ids)), c.seq.images)
                bs = self.pool.block_size
                if self.snapshot is not None and c.end % bs == 0 and 0 < c.end <= len(c.seq.prompt_ids):
                    self.snapshot(c.seq, c.seq.prompt_hashes(bs)[c.end // bs - 1])
        sampled = [c.seq for c in chunks if c.completes_sequence]
        assert len(sampled) == len(token_ids), (len(sampled), len(token_ids))
        for seq, token in zip(sampled, token_ids):
            seq.append_token(token)
            if seq.finish_reason is None:
                continue
            self.finish(seq, seq.finish_reason)
            if seq.finish_reason == "prefilled" or seq.hand_back:
                self.handing_off.append(seq)
            else:
                self.free(seq)
        return sampled

    # -- which sequences are here --------------------------------------------------------------------
    def sequences(self) -> list[Sequence]:
        """Every sequence holding or awaiting blocks here: waiting, running, or finished and handing off."""
        return self.waiting + self.running + self.handing_off

    def get(self, request_id: str) -> Sequence | None:
        return next((s for s in self.sequences() if s.request_id == request_id), None)

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.finish(seq, "abort")
        self.free(seq)

    def free(self, seq: Sequence) -> None:
        """`seq` leaves this scheduler (its KV copied out, or finished, or aborted): its blocks go back."""
        if seq in self.handing_off:
            self.handing_off.remove(seq)
        self.pool.free(seq.block_table)
        if self.release is not None:
            self.release(seq)
