"""Decode attention reading the paged KV pool in place, against today's gather + SDPA (issue 20, item 3).

`python -m lab.paged_read --contexts 128,512,2048 --batch 8` builds one layer's pool (the `small`
tiny model's shapes: 8 query heads, 4 KV heads, head_dim 64, 16-token blocks) with every request's
blocks scattered at random, then times one decode step's attention for one layer, interleaved,
several repeats, medians:

- gather: workers/paged_attention._attend as the engine runs it (index_select of the request's
  blocks into a dense copy, then SDPA with the padding mask);
- flex: torch's flex_attention (compiled by inductor, CPU) over the whole pool viewed as one long
  key sequence, never copied: a BlockMask whose blocks are the pool's blocks says which request
  owns which block, and the mask_mod keeps a request's keys below its length. Built once per
  step, outside the timed call (a real step would build it once for all layers), and timed apart.

Both outputs are checked against each other (max abs difference printed). A block owned by
one request only: shared prefix blocks would need a [requests, blocks] table in the mask instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="100,500,2000", help="tokens of context per request (default 100,500,2000)")
    p.add_argument("--batch", type=int, default=8, help="requests decoding together (default 8)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians (default 7)")
    p.add_argument("--iters", type=int, default=20, help="calls timed per repeat (default 20)")
    p.add_argument("--create-block-mask", action="store_true",
                   help="build the BlockMask with create_block_mask instead of from the block tables")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON here")


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def _pool(batch: int, context: int, seed: int = 0):
    """A pool with 2x the blocks needed, each request's blocks at random places in it."""
    g = torch.Generator().manual_seed(seed)
    per_req = -(-context // BLOCK)
    num_blocks = 2 * batch * per_req + 1
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g)[: batch * per_req] + 1
    tables = perm.view(batch, per_req).tolist()
    q = torch.randn(1, HEADS, batch, HEAD_DIM, generator=g)
    return q, k, v, tables


def gather_attention(q, k, v, tables, context: int):
    from mserve.workers.paged_attention import KVCache, PagedBatch, _attend

    kv = KVCache(1, k.shape[0], KV_HEADS, BLOCK, HEAD_DIM)
    batch = PagedBatch.build(kv, [(t, context - 1, 1) for t in tables], torch.device("cpu"))
    group = batch.groups[0]
    return lambda: _attend(group, q[0], k, v, None)  # [batch, heads, head_dim]


def flex_attention_fn(q, k, v, tables, context: int, from_tables: bool = True):
    """The flex path: (the compiled call, the block-mask builder), over the pool as one key sequence.

    `from_tables`: the BlockMask made straight from the block tables; else by create_block_mask,
    which evaluates the mask over every (request, pool key): tens of ms a step (measured)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    num_blocks = k.shape[0]
    owner = torch.full((num_blocks,), -1, dtype=torch.long)
    logical = torch.zeros(num_blocks, dtype=torch.long)
    for r, blocks in enumerate(tables):
        owner[blocks] = r
        logical[blocks] = torch.arange(len(blocks))
    lens = torch.full((len(tables),), context, dtype=torch.long)

    def mask_mod(b, h, q_idx, kv_idx):  # request b's one query sees its own blocks, up to its length
        blk = kv_idx // BLOCK
        return (owner[blk] == b) & (logical[blk] * BLOCK + kv_idx % BLOCK < lens[b])

    batch = len(tables)

    # kv_indices' last dimension is the number of KV blocks of the whole (pool-long) key sequence.
    # Full blocks (every key seen, no mask_mod) and the partial last block, if any, as kv_indices
    # whose last dimension is the number of KV blocks of the whole (pool-long) key sequence.
    full, part = torch.zeros(batch, num_blocks, dtype=torch.int32), torch.zeros(batch, num_blocks, dtype=torch.int32)
    n_full = torch.zeros(batch, 1, 1, dtype=torch.int32)
    n_part = torch.zeros(batch, 1, 1, dtype=torch.int32)
    for r, blocks in enumerate(tables):
        f = context // BLOCK
        full[r, :f] = torch.tensor(blocks[:f], dtype=torch.int32)
        n_full[r] = f
        if context % BLOCK:
            part[r, 0], n_part[r] = blocks[f], 1

    def build():
        if from_tables:  # the block tables are the BlockMask's KV block indices: no mask evaluated
            return BlockMask.from_kv_blocks(n_part, part[:, None, None], n_full, full[:, None, None],
                                            BLOCK_SIZE=(1, BLOCK), mask_mod=mask_mod, seq_lengths=(1, num_blocks * BLOCK))
        return create_block_mask(mask_mod, batch, None, 1, num_blocks * BLOCK, device="cpu", BLOCK_SIZE=(1, BLOCK))

    # The pool viewed as one key sequence shared by every request (stride 0 over the batch): no copy.
    kf = k.view(1, num_blocks * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2).expand(batch, -1, -1, -1)
    vf = v.view(1, num_blocks * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2).expand(batch, -1, -1, -1)
    qb = q[0].transpose(0, 1)[:, :, None]  # [batch, heads, 1, head_dim]
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = build()
    return (lambda m=mask: compiled(qb, kf, vf, block_mask=m, enable_gqa=True)[:, :, 0]), build


def _timed(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1000 * (time.perf_counter() - t0) / iters


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        q, k, v, tables = _pool(args.batch, context)
        gather = gather_attention(q, k, v, tables, context)
        t0 = time.perf_counter()
        flex, build = flex_attention_fn(q, k, v, tables, context, not args.create_block_mask)
        diff = float((flex() - gather()).abs().max())
        compile_s = time.perf_counter() - t0
        g_ms, f_ms, b_ms = [], [], []
        for _ in range(args.repeats):
            g_ms.append(_timed(gather, args.iters))
            f_ms.append(_timed(flex, args.iters))
            b_ms.append(_timed(build, max(1, args.iters // 4)))
        g, f, b = statistics.median(g_ms), statistics.median(f_ms), statistics.median(b_ms)
        rows.append({"context": context, "batch": args.batch, "gather_sdpa_ms": g, "flex_ms": f,
                     "block_mask_build_ms": b, "speedup_attention_only": g / f, "max_abs_diff": diff,
                     "first_call_s": compile_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.paged_read", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args)
    print(json.dumps(rows, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
