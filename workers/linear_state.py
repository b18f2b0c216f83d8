"""Linear-attention (Gated DeltaNet) layers in the packed step: each sequence's conv + recurrent state.

The paged pool holds K/V for the full-attention layers only. A linear layer's memory of a sequence is a
fixed-size state instead: transformers' own LinearAttentionLayer (the cache HF generate keeps), one per
linear layer inside one Cache per sequence, kept here by request id from its first chunk until the
scheduler releases the sequence. The step's packed rows are split by chunk and each sequence's rows run
the checkpoint's own GatedDeltaNet module with that sequence's cache, so the math is the model's: a
prompt chunk continues the state its previous chunk left (the chunked rule from that initial state, the
conv over the cached last inputs), a decode token steps the recurrent rule, as in HF generate.

Decode tokens are batched: the step's single-token chunks of sequences that already have a state (`stepping`)
run the module once for them all, as HF generate runs a batch: their conv and recurrent states are stacked
into one batch cache (`DecodeBatch`), the module's own code steps them (one conv update, one recurrent
step over [B, ...]), and each row of the result is copied back into its sequence's cache. A prompt chunk
still runs alone (its rows are its sequence's only).

A prefix-cache hit needs the state at the end of the cached prefix, which the K/V blocks do not hold:
`snapshot` keeps a copy of a sequence's state where a prompt chunk ends on a block boundary (the scheduler
ends one chunk of every prompt at its last full block, workers/scheduler.py), keyed by that block's chain
hash, in an LRU of `max_snapshots`; the pool reuses a prefix only up to a block with a snapshot
(BlockPool.prefix_end_ok) and `restore` starts the new sequence from a copy of it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

LINEAR = "linear_attention"


def linear_layers(text_config: Any) -> list[int]:
    """The indices of the text model's linear-attention layers (none for a plain transformer)."""
    return [i for i, kind in enumerate(getattr(text_config, "layer_types", None) or ()) if kind == LINEAR]


def state_bytes_per_sequence(text_config: Any, dtype: torch.dtype) -> int:
    """One sequence's state in bytes: layers x (conv + recurrent), the rule sizing uses (workers/sizing.py)."""
    from mserve.workers.sizing import linear_state_shape, state_bytes

    shape = linear_state_shape(text_config.to_dict())
    return state_bytes(*shape, torch.tensor([], dtype=dtype).element_size())


@dataclass(frozen=True)
class LinearRows:
    """One step's linear-layer work: per chunk, in packed order, its sequence's cache and row count; the
    chunks run together as one decode batch (indices into the chunks), and that batch, or None."""

    caches: tuple[Any, ...]
    lengths: tuple[int, ...]
    stepping: tuple[int, ...] = ()
    batch: "DecodeBatch | None" = None


class DecodeBatch:
    """One step's decode tokens through the linear layers in one call per layer: a scratch Cache whose every
    linear layer is one shared LinearAttentionLayer, its buffers [B, ...] refilled per layer from the
    sequences' caches (in `caches` order) and copied back after the module stepped them."""

    def __init__(self, kinds: Sequence[str], caches: Sequence[Any]) -> None:
        from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

        self.caches = tuple(caches)
        self.shared = LinearAttentionLayer()
        self.cache = Cache(layers=[self.shared if k == LINEAR else DummyLayer() for k in kinds])

    def run(self, inner: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, 1, hidden] (row b: caches[b]'s token) -> the module's output, each state stepped."""
        i = inner.layer_idx
        layers = [c.layers[i] for c in self.caches]
        convs, recurrents = [l.conv_states[0] for l in layers], [l.recurrent_states[0] for l in layers]
        if not self.shared.has_previous_state[0]:  # first layer of the step: the buffers, shaped [B, ...]
            _load(self.shared, torch.cat(convs), torch.cat(recurrents))
        else:
            torch.cat(convs, out=self.shared.conv_states[0])
            torch.cat(recurrents, out=self.shared.recurrent_states[0])
        out = inner(hidden, cache=self.cache)
        for b, layer in enumerate(layers):  # scatter: row b is caches[b]'s state one token on
            layer.conv_states[0].copy_(self.shared.conv_states[0][b : b + 1])
            layer.recurrent_states[0].copy_(self.shared.recurrent_states[0][b : b + 1])
            layer.increase_count(0)  # the token count HF's single-sequence step keeps
        return out


def _load(layer: Any, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Give a fresh LinearAttentionLayer these conv and recurrent states (copies), as after a prefill."""
    layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent)
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(recurrent)
    layer.has_previous_state[0] = True


class LinearStates:
    """The per-sequence caches of one engine's linear layers, by request id."""

    def __init__(self, text_config: Any, max_snapshots: int = 0, batch_decode: bool = True) -> None:
        self.kinds = list(text_config.layer_types)
        self.batch_decode = batch_decode  # False: every chunk runs alone (the per-sequence path)
        self.batched_tokens = 0  # decode tokens that ran in a DecodeBatch
        self.layers = linear_layers(text_config)
        self._caches: dict[str, Any] = {}
        self.max_snapshots = max_snapshots
        self._snapshots: OrderedDict[str, list[torch.Tensor]] = OrderedDict()  # block hash -> state, LRU
        self.snapshots_taken = self.snapshots_restored = self.snapshots_evicted = 0

    def __len__(self) -> int:
        return len(self._caches)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._caches

    def _new(self):
        from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

        return Cache(layers=[LinearAttentionLayer() if k == LINEAR else DummyLayer() for k in self.kinds])

    def for_chunk(self, request_id: str, start: int):
        """The cache a chunk from position `start` continues. A chunk from 0 starts a fresh state (a new
        request, or a preempted one recomputed from scratch: what it had is dropped)."""
        if start == 0:
            self._caches[request_id] = self._new()
        cache = self._caches.get(request_id)
        assert cache is not None, f"request {request_id}: a chunk from {start} but no linear-layer state"
        return cache

    def rows(self, chunks: Sequence[tuple[str, int, int]]) -> LinearRows:
        """(request id, start, tokens) per chunk of the step -> what the wrapped layers read. A one-token chunk
        after position 0 continues a state (its sequence's cache has one): HF steps that state by the
        recurrent rule, and two or more such chunks step together in a DecodeBatch."""
        caches = tuple(self.for_chunk(r, s) for r, s, _ in chunks)
        stepping = tuple(j for j, (_, s, n) in enumerate(chunks) if n == 1 and s > 0) if self.batch_decode else ()
        if len(stepping) < 2:
            return LinearRows(caches, tuple(n for _, _, n in chunks))
        self.batched_tokens += len(stepping)
        return LinearRows(caches, tuple(n for _, _, n in chunks), stepping,
                          DecodeBatch(self.kinds, [caches[j] for j in stepping]))

    def drop(self, request_id: str) -> None:
        """The sequence left this engine (finished, aborted, handed on) or was preempted: its state goes."""
        self._caches.pop(request_id, None)

    def export(self, request_id: str) -> list[torch.Tensor]:
        """The sequence's state as tensors, per linear layer its conv then its recurrent state."""
        cache = self._caches[request_id]
        out = []
        for i in self.layers:
            layer = cache.layers[i]
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        return out

    # -- snapshots at block boundaries: what a prefix hit resumes from ----------------------------------
    def holds(self, block_hash: str) -> bool:
        return block_hash in self._snapshots

    def snapshot(self, request_id: str, block_hash: str) -> None:
        """Keep a copy of the sequence's state as it is now, the state after the block `block_hash` ends."""
        if self.max_snapshots <= 0 or request_id not in self._caches:
            return
        if block_hash in self._snapshots:  # the same prefix again: the same state, only fresher in the LRU
            self._snapshots.move_to_end(block_hash)
            return
        self._snapshots[block_hash] = [t.clone() for t in self.export(request_id)]
        self.snapshots_taken += 1
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
            self.snapshots_evicted += 1

    def restore(self, request_id: str, block_hash: str, device: torch.device) -> None:
        """Start the sequence from the snapshot after block `block_hash` (a prefix hit ending there)."""
        self._snapshots.move_to_end(block_hash)
        self.adopt(request_id, self._snapshots[block_hash], device)
        self.snapshots_restored += 1

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def snapshot_bytes(self) -> int:
        return sum(t.nbytes for ts in self._snapshots.values() for t in ts)

    def snapshot_stats(self) -> dict[str, int]:
        """The snapshots' counters, for the worker's STATUS (docs/operations.md, sizing)."""
        return {"state_snapshots": self.num_snapshots, "state_snapshot_bytes": self.snapshot_bytes(),
                "state_snapshots_taken": self.snapshots_taken, "state_snapshots_restored": self.snapshots_restored,
                "state_snapshots_evicted": self.snapshots_evicted}

    def adopt(self, request_id: str, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        """Take a state another engine exported (`export`): the request continues from it here."""
        assert len(tensors) == 2 * len(self.layers), f"{len(tensors)} state tensors for {len(self.layers)} layers"
        cache = self._new()
        for n, i in enumerate(self.layers):
            _load(cache.layers[i], *(t.to(device) for t in tensors[2 * n : 2 * n + 2]))
        self._caches[request_id] = cache


class PerSequenceLinearAttention(torch.nn.Module):
    """Wraps one GatedDeltaNet: in an engine step, runs it once per prompt chunk with that sequence's cache and
    once for the step's decode batch; used outside the engine (HF generate on the same object), it is the
    module itself."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs):
        batch = kwargs.get("mserve_batch")
        rows: LinearRows | None = getattr(batch, "linear", None)
        if rows is None:
            return self.inner(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        # The packed step is [1, T, hidden]: each chunk's rows are one sequence's, run alone with its state
        # (no mask: a chunk has no padding).
        parts = list(torch.split(hidden_states, list(rows.lengths), dim=1))
        outs: list[torch.Tensor | None] = [None] * len(parts)
        if rows.batch is not None:  # the decode tokens: [1, B, hidden] -> [B, 1, hidden], one call
            stepped = rows.batch.run(self.inner, torch.cat([parts[j] for j in rows.stepping], dim=1).transpose(0, 1))
            for b, j in enumerate(rows.stepping):
                outs[j] = stepped[b : b + 1]
        return torch.cat([self.inner(part, cache=c) if out is None else out
                          for part, c, out in zip(parts, rows.caches, outs)], dim=1)


def wrap_linear_layers(language_model: torch.nn.Module) -> int:
    """Put each decoder layer's `linear_attn` behind PerSequenceLinearAttention; returns how many."""
    n = 0
    for layer in getattr(language_model, "layers", ()):
        inner = getattr(layer, "linear_attn", None)
        if inner is not None and not isinstance(inner, PerSequenceLinearAttention):
            layer.linear_attn = PerSequenceLinearAttention(inner)
            n += 1
    return n
