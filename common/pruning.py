"""Opt-in visual-token pruning (`--visual-token-pruning RATIO`): the rules both sides of the cluster share.

Method: FasterVLM (Zhang et al., "[CLS] Attention is All You Need for Training-Free Visual Token
Pruning: Make VLM Inference Faster", arXiv:2412.01818, 2024). Before the language model sees an
image, its visual tokens are ranked by the attention the vision encoder's [CLS] token pays them, in
the layer whose output LLaVA takes as image features (`vision_feature_layer`, the penultimate one
for llava-1.5), averaged over heads; the top ceil(ratio * N) tokens are kept, in their original
order. Pruning happens on the encode side, so the prompt simply has fewer placeholder tokens: the
paged KV pool, prefix hashing, transfers and decode need nothing new.

Why this one and not FastV (drop tokens inside the LLM after layer K): FastV would change the KV of
a request half way through its prefill, which paged blocks, chunked prefill and the prefill -> decode
hand-off would all have to know about; FasterVLM prunes before the LLM, and its paper reports better
accuracy than FastV-style text-visual attention ranking at equal reduction ratios.

Supported: LLaVA (llava-hf layout) with a CLIP vision tower and one `vision_feature_layer`. Refused:
Qwen2-VL / Qwen2.5-VL (no [CLS] token, and the M-RoPE grid positions of the kept tokens would have to
travel with each image; see docs/operations.md), SigLIP towers (no [CLS] token).

The count rule lives here, torch-free, so admission (coordinator) and the encoder (workers) can never
disagree on how many placeholders an image becomes. The ratio must be the same on the coordinator and
every worker that encodes (encode, unified): workers announce theirs in READY and the coordinator
refuses a mismatch (`mismatch`).
"""

from __future__ import annotations

import argparse
import math
from fractions import Fraction
from typing import Any

SETTING = "visual_token_pruning"  # the settings field (MSERVE_VISUAL_TOKEN_PRUNING)
FLAG = "--visual-token-pruning"
METHOD = "FasterVLM ([CLS] attention, arXiv:2412.01818)"
ENCODING_ROLES = ("encode", "unified")  # the roles whose setting must match the coordinator's
_OFF = ("", "off", "none", "no", "false")


class PruningError(ValueError):
    """A bad or unsupported --visual-token-pruning value; the message names the setting."""


def parse_ratio(value: Any) -> float | None:
    """A keep ratio in (0, 1], or None for off (None, "off", "none", ""). Raises PruningError."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise PruningError(f"{FLAG} ({SETTING}) must be a keep ratio in (0, 1] or 'off', got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
        raise PruningError(f"{FLAG} ({SETTING}) must be a keep ratio in (0, 1] (the share of each image's "
                           f"visual tokens kept), got {value!r}")
    return ratio


def kept_tokens(num_tokens: int, ratio: float | None) -> int:
    """How many of an image's `num_tokens` visual tokens survive: ceil(ratio * N), at least 1.

    Exact decimal arithmetic (0.1 * 30 is 3, not 3.0000000000000004 rounded up to 4)."""
    if ratio is None or num_tokens <= 0:
        return num_tokens
    exact = Fraction(repr(float(ratio))) * num_tokens
    return max(1, min(num_tokens, math.ceil(exact)))


def normalized(ratio: float | None) -> float:
    """1.0 for off: keeping every token in its order is exactly the unpruned embedding."""
    return 1.0 if ratio is None else float(ratio)


def describe(ratio: float | None) -> str:
    return "off" if ratio is None else f"{METHOD}, keep ratio {ratio:g}"


def unsupported(family: Any) -> str | None:
    """Why this checkpoint's family cannot prune (a ModelFamily), or None."""
    if family.uses_mrope:
        return (f"{family.model_type} is not supported: it has no [CLS] token to rank by, and its M-RoPE grid "
                f"positions would have to follow each kept token (only LLaVA checkpoints can prune)")
    if family.model_type != "llava":
        return f"model_type {family.model_type} is not supported (only llava)"
    tower = family.vision_config.get("model_type", "clip_vision_model")
    if tower != "clip_vision_model":
        return f"the vision tower is {tower}, not CLIP: FasterVLM ranks tokens by the [CLS] token's attention"
    return None


def attention_layer(vision_feature_layer: Any, num_layers: int) -> int:
    """The encoder layer whose attention ranks the tokens: the one that produces the feature layer's
    hidden states (hidden_states[k] is the output of layer k - 1; the embeddings are hidden_states[0])."""
    if not isinstance(vision_feature_layer, int) or isinstance(vision_feature_layer, bool):
        raise PruningError(f"{FLAG}: vision_feature_layer {vision_feature_layer!r} is not supported "
                           f"(one layer index is needed to rank tokens by its [CLS] attention)")
    index = num_layers + vision_feature_layer if vision_feature_layer < 0 else vision_feature_layer - 1
    if not 0 <= index < num_layers:
        raise PruningError(f"{FLAG}: vision_feature_layer {vision_feature_layer} has no attention layer "
                           f"among the vision tower's {num_layers} layers")
    return index


def apply(family: Any, ratio: Any) -> float | None:
    """Validate `ratio` for this family and make its visual token counts the pruned ones; returns the ratio.

    Raises PruningError naming the setting when the value is bad or the family cannot prune."""
    ratio = parse_ratio(ratio)
    if ratio is not None:
        why = unsupported(family)
        if why is not None:
            raise PruningError(f"{FLAG} ({SETTING}={ratio:g}): {why}")
    family.visual_keep_ratio = ratio
    return ratio


def mismatch(worker_id: str, role: str, worker_ratio: float | None, own_ratio: float | None) -> str | None:
    """Why the coordinator must refuse this worker's registration, or None when the settings agree."""
    if role not in ENCODING_ROLES or normalized(worker_ratio) == normalized(own_ratio):
        return None

    def show(r: float | None) -> str:
        return "off" if r is None else f"{r:g}"

    return (f"worker {worker_id} ({role}) refused: it runs {FLAG} {show(worker_ratio)} but this coordinator "
            f"counts image placeholders with {FLAG} {show(own_ratio)}; set the same value "
            f"(MSERVE_VISUAL_TOKEN_PRUNING) on the coordinator and on every encode and unified worker")


def cache_namespace(model_name: str, ratio: float | None) -> str:
    """A cache key prefix that keeps embeddings pruned at different ratios apart (off and 1.0 are alike)."""
    return model_name if normalized(ratio) == 1.0 else f"{model_name}#keep={ratio:g}"


def pruned_hash(image_hash: str, ratio: float | None) -> str:
    """The key of one image's embeddings when one request prunes it at its own `ratio` (SLO-adaptive
    pruning, coordinator/adaptive_pruning.py): `hash#k0.5`, so every cache keyed by image hash (the
    encoders' embedding caches, the Redis embedding index, single-flight leases, prefix blocks) keeps
    them apart from the image's unpruned embeddings. None: the hash itself."""
    return image_hash if ratio is None else f"{image_hash}#k{ratio:g}"


def _flag_value(value: str) -> str:
    """argparse type: checked here (a clean usage error), parsed later by the settings."""
    try:
        parse_ratio(value)
    except PruningError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_argument(parser: argparse.ArgumentParser, who: str) -> None:
    """The --visual-token-pruning flag of `mserve generate`, `coordinator`, `worker` and `up`."""
    parser.add_argument(FLAG, type=_flag_value, metavar="RATIO",
                        help=f"opt-in visual-token pruning, {METHOD}: keep this share (0, 1] of each image's "
                             f"visual tokens, those the vision tower's [CLS] attends to most; LLaVA only; "
                             f"'off' (default). {who}")
