"""The paged KV pool's tensors and the attention function transformers calls to read and write them.

Registered with transformers' `AttentionInterface` as "mserve_paged": every decoder layer of the
checkpoint's own model runs unchanged and hands us its query/key/value after RoPE. One forward
covers a packed batch of requests of any lengths (prefill chunks and decode tokens together):
new K/V are scattered into the pool by slot, then each request attends over its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mserve.workers import attention_masks, huge_pages, paged_decode, paged_prefill, text_traits

ATTN_IMPLEMENTATION = "mserve_paged"


class KVCache:
    """Per layer, K and V as [num_blocks, block_size, kv_heads, head_dim].

    Indexed by the text model's layer index; a layer that keeps no K/V (kv_sources) has None there.

    Token-major inside a block: a request's blocks gathered by one `index_select` (whole blocks,
    contiguous memory) are already its keys as [tokens, kv_heads, head_dim], which SDPA reads
    through a transposed view. A heads-first layout needs a strided gather that costs ~4x more
    (measured: 1.7-2.1 ms vs 0.25-0.46 ms per layer for 32 requests of 8 blocks on `small`).
    On the CPU the tensors sit on huge pages where the host gives them (workers/huge_pages.py)."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layer_shapes: Sequence[tuple[int, int]] | None = None,
                 kv_sources: Sequence[int | None] | None = None) -> None:
        """`layer_shapes`: each layer's (kv_heads, head_dim) where layers differ (Gemma 4's global layers
        are wider than its sliding ones); None: every layer is (kv_heads, head_dim). `kv_sources`: the
        layer whose K/V each layer attends over, where some reuse an earlier layer's (Gemma 4's KV-shared
        layers): such a layer holds no tensors of its own, it reads its source's; None for a layer that
        keeps no K/V at all (a hybrid model's linear-attention layer keeps a per-sequence state instead,
        workers/linear_state.py), whose entries in `k` and `v` are None."""
        shapes = list(layer_shapes) if layer_shapes is not None else [(kv_heads, head_dim)] * num_layers
        sources = list(kv_sources) if kv_sources is not None else list(range(num_layers))
        # Only the layers that are their own source own K/V: they alone are stored, exported and imported.
        self.owned = [i for i in range(num_layers) if sources[i] == i]
        assert self.owned, "a KV pool with no layer that keeps K/V"
        self._owned_set = frozenset(self.owned)
        own = {i: (huge_pages.zeros((num_blocks, block_size, *shapes[i]), dtype, device),
                   huge_pages.zeros((num_blocks, block_size, *shapes[i]), dtype, device)) for i in self.owned}
        self.k = [None if sources[i] is None else own[sources[i]][0] for i in range(num_layers)]
        self.v = [None if sources[i] is None else own[sources[i]][1] for i in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        # Layers of different shapes export each block as one row of the widest layer's heads x dim, the
        # narrower ones zero-padded: one tensor of one shape still carries a request's blocks.
        self._uniform = len({shapes[i] for i in self.owned}) == 1
        self._row = max(shapes[i][0] * shapes[i][1] for i in self.owned)

    def owns(self, layer: int) -> bool:
        """Whether `layer` writes its own K/V (a KV-shared layer's are its source's, written by it)."""
        return layer in self._owned_set

    @property
    def bytes_per_block(self) -> int:
        return 2 * sum(self.k[i][0].numel() * self.k[i].element_size() for i in self.owned)

    def export_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``export_blocks`` for ``num_blocks`` blocks."""
        if not self._uniform:
            return (len(self.owned), 2, num_blocks, self.block_size, 1, self._row)
        return (len(self.owned), 2, num_blocks) + tuple(self.k[self.owned[0]].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.k[self.owned[0]].dtype

    @property
    def device(self) -> torch.device:
        return self.k[self.owned[0]].device

    def export_blocks(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A request's blocks as one tensor [layers, 2, n, block_size, kv_heads, head_dim].

        ``out`` (e.g. a transfer's shared-memory buffer) receives the blocks directly: each block
        is copied exactly once, gathered straight into place.
        """
        expected = self.export_shape(len(block_ids))
        if out is None:
            out = torch.empty(expected, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != expected:
            raise ValueError(f"export buffer of shape {tuple(out.shape)}, expected {expected}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if not self._uniform:
            out.zero_()
            for layer, source in enumerate(self.owned):
                for kind, cache in ((0, self.k[source]), (1, self.v[source])):
                    rows = cache.index_select(0, idx).flatten(2)  # [n, block_size, heads * dim]
                    out[layer, kind, :, :, 0, : rows.shape[-1]].copy_(rows)
            return out
        direct = out.device == self.device and out.dtype == self.dtype and out.is_contiguous()
        for layer, source in enumerate(self.owned):
            for kind, cache in ((0, self.k[source]), (1, self.v[source])):
                if direct:
                    torch.index_select(cache, 0, idx, out=out[layer, kind])
                else:  # another device or dtype: gather here, then one copy across
                    out[layer, kind].copy_(cache.index_select(0, idx))
        return out

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        expected = self.export_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(data.shape)} do not fit this pool (expected {expected})")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, source in enumerate(self.owned):
            k, v = self.k[source], self.v[source]
            width, shape = k[0].numel() // self.block_size, (len(block_ids),) + tuple(k.shape[1:])
            k.index_copy_(0, idx, data[layer, 0].flatten(2)[..., :width].reshape(shape))
            v.index_copy_(0, idx, data[layer, 1].flatten(2)[..., :width].reshape(shape))


@dataclass
class AttentionGroup:
    """Requests of one step whose queries are attended together in one dense SDPA call."""

    block_tables: torch.Tensor  # [G, max_blocks] padded with block 0
    query_index: torch.Tensor  # [G, max_q] index of each request's queries in the packed T (padded)
    mask: torch.Tensor  # [G, 1, max_q, max_blocks * block_size] True = may attend
    out_rows: torch.Tensor  # rows of the flattened [G * max_q] output that are real tokens...
    dest: torch.Tensor  # ...and where each goes in the packed T
    # Every request has max_q tokens and the group is the whole packed batch in order: queries and
    # outputs are reshaped instead of gathered and scattered.
    whole_uniform: bool = False
    query_pos: torch.Tensor | None = None  # [G, max_q] each query's position in its sequence
    # Exact-length attention (reduced precision): each request's context length. Requests of one
    # length attend together over exactly their keys, never over masked padding (see _attend_exact).
    key_lens: tuple[int, ...] | None = None
    # A group of one prompt's first chunk (position 0, causal only): its token count. Such a chunk
    # attends causally over exactly its own keys, `is_causal` and no mask, as HF's prefill calls SDPA
    # (the same bits as the masked call, measured; the CPU kernel skips what its blocking lets it above
    # the diagonal: 11 % faster at 512 tokens).
    fresh_prompt: int | None = None
    # A group of decode tokens (one query each, causal only): each request's context length, for the
    # kernel that reads the pool in place (workers/paged_decode.py), and the longest.
    decode_lens: torch.Tensor | None = None
    max_len: int = 0
    causal: bool = True  # no bidirectional image runs: the mask is the causal one
    _local: dict = field(default_factory=dict)  # (window, chunk) -> mask, built on first use

    def local(self, window: int | None, chunk: int | None) -> bool:
        """Whether a sliding window or an attention chunk hides a key from some query of this group (a
        window as long as every context, like the 32k one Qwen2-VL passes on every layer, hides none; nor
        does a chunk no query reaches the end of)."""
        return any(size is not None and size < self.max_len for size in (window, chunk))

    def local_mask(self, window: int | None, chunk: int | None) -> torch.Tensor:
        """`mask` limited by the layer's sliding window or attention chunk (attention_masks.local_keys)."""
        if (window, chunk) not in self._local:
            self._local[(window, chunk)] = self.mask & attention_masks.local_keys(
                self.query_pos, self.mask.shape[-1], window, chunk)[:, None]
        return self._local[(window, chunk)]

    @classmethod
    def build(cls, chunks: Sequence[tuple[Sequence[int], int, int, int, Sequence[tuple[int, int]]]], bs: int,
              total: int, device: torch.device, exact: bool = False) -> "AttentionGroup":
        """`chunks`: per request (block ids, first position, number of tokens, offset in the packed T,
        the (start, end) runs of its images whose tokens attend to each other both ways)."""
        max_q = max(c[2] for c in chunks)
        max_blocks = max(len(c[0]) for c in chunks)
        q_index, q_pos, out_rows, dest, tables = [], [], [], [], []
        for i, (blocks, start, n, packed, _) in enumerate(chunks):
            # Padded query rows repeat the last real query: they never see an empty key set (NaN).
            q_index.append([packed + min(j, n - 1) for j in range(max_q)])
            q_pos.append([start + min(j, n - 1) for j in range(max_q)])
            out_rows.extend(i * max_q + j for j in range(n))
            dest.extend(range(packed, packed + n))
            tables.append(list(blocks) + [0] * (max_blocks - len(blocks)))
        key_pos = torch.arange(max_blocks * bs, device=device)
        qp = torch.tensor(q_pos, device=device)
        mask = key_pos[None, None, :] <= qp[:, :, None]  # causal; also bounds keys to the context
        if any(c[4] for c in chunks):
            mask |= attention_masks.same_image(chunks, max_blocks * bs, qp, device)
        whole = len(dest) == total and dest == list(range(total)) and all(c[2] == max_q for c in chunks)
        return cls(block_tables=torch.tensor(tables, dtype=torch.long, device=device),
                   query_index=torch.tensor(q_index, dtype=torch.long, device=device), mask=mask[:, None],
                   out_rows=torch.tensor(out_rows, dtype=torch.long, device=device),
                   dest=torch.tensor(dest, dtype=torch.long, device=device), whole_uniform=whole, query_pos=qp,
                   key_lens=tuple(c[1] + c[2] for c in chunks) if exact else None,
                   fresh_prompt=max_q if len(chunks) == 1 and chunks[0][1] == 0 and max_q > 1 and not chunks[0][4]
                   else None,
                   decode_lens=qp[:, 0] + 1 if max_q == 1 and not any(c[4] for c in chunks) else None,
                   max_len=max(c[1] + c[2] for c in chunks), causal=not any(c[4] for c in chunks))


@dataclass
class PagedBatch:
    """Where one step's tokens go in the pool and what each request attends to.

    Requests are grouped by query length: all decode tokens (one query each) in one group, each
    prefill chunk in its own. Padding every request of a mixed step to the longest chunk would
    make a decode token pay for a 512-query attention (measured: steps several times slower)."""

    kv: KVCache
    slots: torch.Tensor  # [T] where each new token's K/V go: block * block_size + offset
    groups: list[AttentionGroup]
    # The step's linear-attention work (workers/linear_state.LinearRows), for hybrid models; None otherwise.
    linear: Any = None
    # The same requests attending causally only, for the layers without a sliding window when images are
    # bidirectional on sliding-window layers alone (Gemma 4); None: every layer attends through `groups`.
    full_layer_groups: list[AttentionGroup] | None = None
    # Each packed token's position in its sequence [T] (what Llama 4's temperature tuning scales by).
    positions: torch.Tensor | None = None
    # Each layer's attention chunk (Llama 4's chunked local layers: a query attends within
    # [pos // chunk * chunk, pos]), None on the others; None: no layer is chunked.
    layer_chunks: Sequence[int | None] | None = None

    def groups_for(self, window: int | None) -> list[AttentionGroup]:
        """The groups one layer attends through: `window` is its sliding window, None on a full layer."""
        return self.full_layer_groups if window is None and self.full_layer_groups is not None else self.groups

    @classmethod
    def build(cls, kv: KVCache, chunks: Sequence[tuple[Sequence[int], int, int]], device: torch.device,
              image_runs: Sequence[Sequence[tuple[int, int]]] | None = None, exact: bool = False,
              images_on_sliding_only: bool = False,
              layer_chunks: Sequence[int | None] | None = None) -> "PagedBatch":
        """`chunks`: per request (block ids, first position computed, number of tokens). `image_runs`:
        per request, the (start, end) of each image whose tokens attend to each other both ways
        (families with bidirectional images; None: all attention is causal), on every layer, or on the
        sliding-window layers only (`images_on_sliding_only`). `exact`: attend over each request's exact
        key count (`--attention exact`: the note under exact_setting says when that matters). `layer_chunks`:
        each layer's attention chunk, or None (PagedBatch.layer_chunks)."""
        batch = cls._build(kv, chunks, device, image_runs, exact)
        batch.layer_chunks = layer_chunks
        if images_on_sliding_only and image_runs is not None:
            batch.full_layer_groups = cls._build(kv, chunks, device, None, exact).groups
        return batch

    @classmethod
    def _build(cls, kv: KVCache, chunks: Sequence[tuple[Sequence[int], int, int]], device: torch.device,
               image_runs: Sequence[Sequence[tuple[int, int]]] | None, exact: bool) -> "PagedBatch":
        bs = kv.block_size
        slots, by_len, positions = [], {}, []
        packed = 0
        for i, (blocks, start, n) in enumerate(chunks):
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in positions[-n:])
            # A run matters only to queries from its start on: decode tokens past every image skip it.
            runs = tuple(r for r in (image_runs[i] if image_runs else ()) if r[1] > start)
            # One query each (decode) go together; a longer chunk goes with chunks of its own length.
            by_len.setdefault(n, []).append((blocks, start, n, packed, runs))
            packed += n
        return cls(
            kv=kv,
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            groups=[AttentionGroup.build(g, bs, packed, device, exact) for g in by_len.values()],
            positions=torch.tensor(positions, dtype=torch.long, device=device),
        )


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, head_dim], whole blocks at a time.

    One contiguous copy per block; the result is a transposed view of [B, L, kv_heads, head_dim]."""
    b, nb = tables.shape
    _, bs, h, d = cache.shape
    return cache.index_select(0, tables.view(-1)).view(b, nb * bs, h, d).transpose(1, 2)


def _tokens(query: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """query [heads, T, head_dim] -> its tokens `index` (flat) as [len(index), heads, head_dim].

    An `index_select` over whole token rows (one copy a row), where advanced indexing on the middle dim
    copies element by element: in a step of 16 decode tokens and a 496-token chunk, the chunk's query
    gather, its output's gather and the scatter back took 392-402 us a layer that way and 146-153 this
    way, the same bits (`lab.token_copies`; bench/lab/NOTEBOOK.md, "Where a served request's time goes")."""
    return query.transpose(0, 1).index_select(0, index)


def _attend(group: AttentionGroup, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scaling: float | None, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """One group's attention output as [rows, heads, head_dim] (rows = its real tokens, in `dest` order).
    `window`: the layer's sliding window; `chunk`: its attention chunk (None: not that kind of layer)."""
    g, max_q = group.query_index.shape
    heads, _, d = query.shape
    # A window or chunk that hides keys makes the mask not the causal one: the in-place kernels, the
    # causal-only call and exact-length attention do not apply.
    local = group.local(window, chunk)
    if (group.decode_lens is not None and group.key_lens is None and not local
            and paged_decode.usable(query, k_cache)):  # decode tokens: read the pool in place, no gather
        q = query.transpose(0, 1) if group.whole_uniform else _tokens(query, group.query_index[:, 0])
        return paged_decode.attend(q, k_cache, v_cache, group.block_tables, group.decode_lens, group.max_len,
                                   scaling if scaling is not None else d ** -0.5)
    if (group.decode_lens is None and group.key_lens is None and group.causal and len(group.dest) == g * max_q
            and not local and paged_prefill.usable(query, k_cache)):
        # prompt chunks of one length in bfloat16, padded attention: read the pool in place
        q = query.transpose(0, 1) if group.whole_uniform else _tokens(query, group.query_index.view(-1))
        out = paged_prefill.attend(q.reshape(g, max_q, heads, d), k_cache, v_cache, group.block_tables,
                                   group.query_pos[:, 0], scaling if scaling is not None else d ** -0.5)
        out = out.view(g * max_q, heads, d)
        return out if group.whole_uniform else out.index_select(0, group.out_rows)
    k = _gather(k_cache, group.block_tables)
    v = _gather(v_cache, group.block_tables)
    if group.whole_uniform:
        q = query.view(heads, g, max_q, d).transpose(0, 1)
    else:
        q = _tokens(query, group.query_index.view(-1)).view(g, max_q, heads, d).transpose(1, 2)  # [G, heads, max_q, d]
    if group.fresh_prompt is not None and not local:
        n = group.fresh_prompt
        out = F.scaled_dot_product_attention(q, k[:, :, :n].to(q.dtype), v[:, :, :n].to(q.dtype), is_causal=True,
                                             scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    elif group.key_lens is None or (chunk is not None and group.local(None, chunk)):
        # exact attention honours a sliding window itself (_attend_exact); an attention chunk takes the mask
        mask = group.local_mask(window, chunk) if local else group.mask
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = _attend_exact(group, q, k.to(q.dtype), v.to(q.dtype), scaling, window)
    out = out.transpose(1, 2).reshape(g * max_q, heads, d)
    return out if group.whole_uniform else out.index_select(0, group.out_rows)


def exact_setting(choice: str | None) -> bool:
    """`--attention` as EngineConfig.exact_attention: auto (or none named) is padded (the note below says why)."""
    return choice == "exact"


# Why exact attention exists, and why it is not the default.
#
# SDPA's CPU kernel sums a row's softmax in vector lanes over the keys it is given: masked padding keys
# add zeros but regroup the sum, so a request padded to its batch's longest context can land one ulp
# away from HF's unpadded call (measured, torch 2.13 CPU/AVX2: 1 call in ~12 whenever the length is not
# a multiple of 8); the CPU bf16 kernels (paged_decode.py, paged_prefill.py) round differently again.
# In float32 such an ulp has not changed a token. In bfloat16 it changes one only where HF's own top-2
# logits are within bf16 rounding of each other, a tie either order is a correct reading of
# (common/exactness.py; vLLM checks its kernels the same way). Exact attention (one SDPA call per
# distinct context length and layer) reproduces HF bf16's bits there too, at a fraction of the padded
# path's rate (bench/lab/NOTEBOOK.md): it is what `--attention exact` asks for, and the default is padded.


def _attend_exact(group: AttentionGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scaling: float | None, window: int | None = None) -> torch.Tensor:
    """The group's SDPA output [G, heads, max_q, head_dim], each request over exactly the keys HF's is given.

    Called as HF calls SDPA without padding: no mask where a query sees every key (decode: on a sliding
    layer the last `window` keys, all DynamicSlidingWindowLayer hands it), and `is_causal` for a whole
    causal prompt in one chunk (on CUDA a mask would also pick another kernel); a prompt whose mask is not
    the causal one (a window shorter than it, images attending both ways) over its own keys with that mask."""
    out = q.new_empty(q.shape)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(group.key_lens):
        by_len.setdefault(n, []).append(i)
    max_q = q.shape[2]
    causal = group.causal and (window is None or window >= max(group.key_lens))
    full = group.mask if window is None else group.local_mask(window, None)
    for n, rows in by_len.items():
        sel = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(rows, device=q.device)
        whole_prompt = causal and n == max_q > 1  # first chunk of a causal prompt: is_causal over its own tokens
        lo = max(0, n - window) if max_q == 1 and window is not None else 0
        mask = None if max_q == 1 or whole_prompt else full[sel, :, :, :n]
        out[sel] = F.scaled_dot_product_attention(q[sel], k[sel, :, lo:n], v[sel, :, lo:n], attn_mask=mask,
                                                  is_causal=whole_prompt, scale=scaling,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return out


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    batch: PagedBatch | None = kwargs.get("mserve_batch")
    if batch is None:  # the model used outside the engine (e.g. HF generate on the same object)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, is_causal=attention_mask is None and query.shape[2] > 1)
    layer = module.layer_idx
    if (tuning := kwargs.get("mserve_temperature")) is not None:  # Llama 4's NoPE layers (text_traits.py)
        query = text_traits.temperature_scaled(query, batch.positions, *tuning)
    k_cache, v_cache = batch.kv.k[layer], batch.kv.v[layer]
    # query/key/value: [1, heads, T, head_dim] for the packed batch; the pool takes [T, kv_heads, head_dim].
    _, bs, h, d = k_cache.shape
    if batch.kv.owns(layer):  # a KV-shared layer is handed its source's K/V, which that layer wrote already
        k_cache.view(-1, h, d).index_copy_(0, batch.slots, key[0].transpose(0, 1).to(k_cache.dtype))
        v_cache.view(-1, h, d).index_copy_(0, batch.slots, value[0].transpose(0, 1).to(v_cache.dtype))
    # The layer's sliding window (transformers passes it for sliding-window layers, None for global ones).
    window = kwargs.get("sliding_window")
    chunk = batch.layer_chunks[layer] if batch.layer_chunks is not None else None
    groups = batch.groups_for(window)
    if len(groups) == 1 and groups[0].whole_uniform:
        out = _attend(groups[0], query[0], k_cache, v_cache, scaling, window, chunk)
    else:
        heads, total, d = query[0].shape
        out = query.new_empty((total, heads, d))
        for group in groups:
            out.index_copy_(0, group.dest, _attend(group, query[0], k_cache, v_cache, scaling, window, chunk))
    return out.unsqueeze(0), None  # [1, T, heads, head_dim], as transformers' attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
