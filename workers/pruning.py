"""FasterVLM visual-token pruning on the encode path (the rules and the citation: common/pruning.py).

The vision forward is the checkpoint's own (`get_image_features`); a forward pre-hook on the one
CLIP attention module of the feature layer reads that module's input and computes the [CLS] query's
attention row with the module's own q/k projections and scale (the row eager attention would return,
whatever attention implementation the tower runs). Each image's tokens are ranked by that row
averaged over heads, and the top ceil(ratio * N) kept in their original order.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

import torch

from mserve.common import pruning
from mserve.common.model import ModelFamily

log = logging.getLogger(__name__)


def cls_attention(attn: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[B, T] attention of token 0 ([CLS]) over all T tokens, averaged over heads, for a CLIP attention
    module and its input (after layer_norm1). Softmax in float32, as transformers' eager attention does."""
    b, t, _ = hidden.shape
    heads, head_dim = attn.num_heads, attn.head_dim
    q = attn.q_proj(hidden[:, :1]).view(b, 1, heads, head_dim).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, t, heads, head_dim).transpose(1, 2)
    weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float() * attn.scale, dim=-1)
    return weights[:, :, 0].mean(dim=1)


class ClsAttentionPruner:
    """Keeps the `ratio` share of each image's visual tokens with the highest [CLS] attention."""

    def __init__(self, model: torch.nn.Module, family: ModelFamily, ratio: float | None) -> None:
        """`ratio`: the worker's fixed keep ratio; None for one that prunes only the requests that
        bring their own (SLO-adaptive pruning: `select(..., ratio)`)."""
        tower = model.model.vision_tower
        vision_model = getattr(tower, "vision_model", tower)
        layers = vision_model.encoder.layers
        self.layer = pruning.attention_layer(model.config.vision_feature_layer, len(layers))
        self.attn = layers[self.layer].self_attn
        # "default" drops CLS from the features (the score row then skips it too); "full" keeps it.
        self.skip_cls = family.vision_feature_select_strategy == "default"
        self.ratio = ratio
        log.info("visual-token pruning %s; ranking by vision layer %d of %d",
                 f"on: {pruning.describe(ratio)}" if ratio is not None else "per request (SLO-adaptive)",
                 self.layer, len(layers))

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """While open, every forward of the feature layer appends its [B, T] [CLS] attention scores."""
        scores: list[torch.Tensor] = []

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            scores.append(cls_attention(module, hidden))

        handle = self.attn.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield scores
        finally:
            handle.remove()

    def keep_indices(self, scores: torch.Tensor, num_tokens: int, ratio: float | None = None) -> torch.Tensor:
        """Sorted indices of the tokens one image keeps, from its [T] score row (at `ratio`, else the worker's)."""
        row = scores[1:] if self.skip_cls else scores
        if row.shape[0] != num_tokens:
            raise RuntimeError(f"visual-token pruning: {row.shape[0]} attention scores for {num_tokens} visual tokens")
        keep = pruning.kept_tokens(num_tokens, self.ratio if ratio is None else ratio)
        return torch.topk(row, keep).indices.sort().values

    def select(self, embeds: Sequence[torch.Tensor], scores: Sequence[torch.Tensor],
               ratio: float | None = None) -> list[torch.Tensor]:
        """Each image's [N, hidden] embeddings -> its kept rows [ceil(ratio * N), hidden], order kept
        (`ratio`: one request's own, else the worker's)."""
        rows = torch.cat(list(scores)) if scores else torch.empty(0)
        if rows.shape[0] != len(embeds):
            raise RuntimeError(f"visual-token pruning: scores for {rows.shape[0]} images, {len(embeds)} encoded")
        out = []
        for e, s in zip(embeds, rows):
            idx = self.keep_indices(s, e.shape[0], ratio).to(e.device)
            out.append(e.index_select(0, idx).contiguous())
        return out
