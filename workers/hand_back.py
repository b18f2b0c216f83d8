"""KV leaving one engine for another: the prefill -> decode hand-off (`KVExport`), and the hand-back.

Hand-off: a prefilled request leaves its prefill engine as `KVExport`, the wire's `KVState` (which
PREFILLED and DECODE carry) plus the tensors the data plane moves; the decode engine adopts it.

Hand-back: a decode worker's finished reply goes back to the prefill worker for the next turn.

A multi-turn conversation resends its whole history: turn N+1's prompt starts with turn N's prompt
and then turn N's reply. The prefill worker that ran turn N still holds the prompt's blocks (freed,
hashed, cached), but the reply was computed on a decode worker. With the coordinator's
`--kv-hand-back`, the decode worker copies the reply's *full* blocks out when the request ends
(`reply_blocks`), the coordinator relays them (ADOPT), and the prefill worker keeps them as cached
blocks chained on the prompt's (`adopt_blocks`), so turn N+1 finds prompt and reply in its prefix.

It pays only when the client sends the reply back as the model wrote it and it tokenizes to the same
ids (a chat template that renders the assistant turn exactly as generated); anything else misses the
cache at the first differing block, which is always safe: block hashes chain token ids and images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from mserve.common.hashing import ImageSpan, prompt_block_hashes
from mserve.common.protocol.to_coordinator import HandBack
from mserve.common.protocol.to_worker import KVState
from mserve.workers.block_pool import BlockPool, BlockTable, OutOfBlocks

if TYPE_CHECKING:
    from mserve.workers.paged_attention import KVCache
    from mserve.workers.sequence import Sequence as Seq


@dataclass
class KVExport:
    """A prefilled request between two engines: its state (on the wire) and its tensors (on the data
    plane). The prompt inputs ride along so the receiver can recompute the prompt if it must preempt it."""

    state: KVState
    kv: torch.Tensor  # [layers, 2, n_blocks, block_size, kv_heads, head_dim]
    mrope_positions: torch.Tensor | None = None  # Qwen2-VL
    image_embeds: list[torch.Tensor] = field(default_factory=list)  # one per image run of the prompt
    # A hybrid model's linear-attention state at num_computed_tokens (workers/linear_state.py): per linear
    # layer its conv then its recurrent state; empty for a model without such layers.
    linear_state: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ReplyBlocks:
    """A finished request's reply blocks, copied out before its blocks are released."""

    kv: torch.Tensor  # [layers, 2, n, block_size, kv_heads, head_dim]
    token_ids: list[int]  # prompt + reply through the last block
    images: list[list[Any]]  # [start, length, image hash] per image of the prompt
    first_block: int  # the first block of `kv` (the ones before it are the prompt's)

    def to_wire(self, descriptor: dict[str, Any]) -> HandBack:
        """What STEP_TOKENS carries once `kv` is published under `descriptor`."""
        return HandBack(descriptor=descriptor, token_ids=self.token_ids, images=self.images,
                        first_block=self.first_block)


def reply_blocks(pool: BlockPool, kv: KVCache, seq: Seq) -> ReplyBlocks | None:
    """The finished request's full blocks past its prompt's last full one, or None when there are none
    (taken before the blocks are released)."""
    bs = pool.block_size
    first = len(seq.prompt_ids) // bs
    last = min(seq.num_computed_tokens // bs, len(seq.block_table.block_ids))  # blocks whose KV is written
    if last <= first:
        return None
    return ReplyBlocks(kv.export_blocks(seq.block_table.block_ids[first:last]), seq.token_ids[: last * bs],
                       [[s.start, s.length, s.image_hash] for s in seq.images], first)


def adopt_blocks(pool: BlockPool, kv: KVCache, token_ids: Sequence[int], images: Sequence[Any], first_block: int,
                 data: torch.Tensor) -> int:
    """Keep handed-back blocks as cached prefix blocks; returns how many were new here.

    Only blocks that extend a chain this pool still holds are kept: if the prompt's blocks were
    evicted meanwhile the reply's could never be matched (a prefix match starts at block 0)."""
    bs = pool.block_size
    n_blocks = first_block + int(data.shape[2])
    if len(token_ids) < n_blocks * bs:
        raise ValueError(f"{len(token_ids)} token ids for {n_blocks} blocks of {bs}")
    spans = [ImageSpan(int(s), int(n), str(h)) for s, n, h in images]
    hashes = prompt_block_hashes(list(token_ids[: n_blocks * bs]), bs, spans)
    held = len(pool.match_prefix(hashes, token_ids))
    if held < first_block or held >= n_blocks:
        return 0
    table = BlockTable()
    try:
        # Reuses the held prefix (up to n_blocks - 1 blocks) and takes fresh blocks for the rest.
        prefix = pool.reusable_prefix(hashes, token_ids, n_blocks * bs)
        cached = pool.allocate(table, n_blocks * bs, prefix) // bs
    except OutOfBlocks:
        return 0
    try:
        if cached < first_block:  # cannot happen after the check above; never import over a gap
            return 0
        kv.import_blocks(table.block_ids[cached:n_blocks], data[:, :, cached - first_block:])
        pool.commit_full_blocks(table, token_ids, n_blocks * bs, spans)
        return n_blocks - cached
    finally:
        pool.free(table)  # hashed blocks stay cached, in LRU order, until the pool needs them
