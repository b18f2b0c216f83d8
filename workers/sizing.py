"""GPU partitioning: a worker's share of a device (a memory fraction or a MIG instance) and the KV pool
that fits in it.

Pure arithmetic over the checkpoint's config.json and its safetensors headers: torch is imported only
by `partition_worker`, on a CUDA device, so the sizing itself is tested on CPU. The formula
(docs/gpu-partitioning.md):

    budget     = device_memory × gpu_memory_fraction
    reserve    = workspace + activations + logits
      workspace   = WORKSPACE_BYTES (512 MiB: CUDA context, cuBLAS/attention workspaces, allocator slack)
      activations = T × (4·H + 3·I) × b   the widest layer's live tensors for one packed step of T tokens
                                          (residual, normed input, q/k/v, attention output, MLP gate/up/product)
      logits      = S × V × 4 × 2         float32 logits of S sequences and the sampler's copy
    kv_budget  = (budget − weights − reserve) / (1 + 1/L)
                                          one layer's K and V are gathered per step beside the pool
    block      = 2 × L × kv_heads × head_dim × block_size × b
    num_blocks = floor(kv_budget / block)

T = max_num_batched_tokens, S = max_num_seqs, H/I/V/L = the text model's hidden, intermediate, vocab
sizes and layers, b = bytes per element of the serving dtype (common/serving_defaults.serving_dtype: bfloat16 on
CUDA and on CPUs with native bf16, float32 on other CPUs, unless `dtype` says otherwise), weights = the parameters this role keeps (encode: vision tower + projector;
prefill/decode: language model + head; unified: all), counted from the safetensors headers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mserve.common.policy import DEFAULT_ENGINE
from mserve.workers.vision_layers import TOWER_LAYER, layers_read

log = logging.getLogger("mserve.sizing")

GIB = 2**30
MIB = 2**20
WORKSPACE_BYTES = 512 * MIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
VISION_MODULES = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector",
                  "audio_tower", "embed_audio")  # as model_loading._VISION_MODULES: the encoder side (audio too)
QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Families whose text model is all in text_config: model_type -> its config class's default text model.
NESTED_TEXT_TYPES = {
    "llava": "llama",
    "mistral3": "mistral",
    "gemma3": "gemma3_text",
    "internvl": "qwen2",
    "smolvlm": "llama",
    "idefics3": "llama",
    "glm46v": "glm4v_text",
    "glm4v": "glm4v_text",
    "glm4v_moe": "glm4v_moe_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}

# What transformers' config classes default to when a config.json leaves a key out (published llava-hf
# text_configs name little more than model_type and vocab_size); checked against transformers in tests.
TEXT_DEFAULTS: dict[str, dict[str, int]] = {
    "llama": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "vocab_size": 32000},
    "mistral": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 32000},
    "gemma3_text": {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208},
    "qwen2": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 151936},
}


def linear_state_shape(text: dict[str, Any]) -> tuple[int, int, int]:
    """A hybrid text model's linear-attention (Gated DeltaNet) layers: (how many, conv state elements,
    recurrent state elements) per sequence and layer; (0, 0, 0) for a model without them. The conv state
    keeps the q/k/v projection's last `linear_conv_kernel_dim` inputs; the recurrent state is
    [value heads, key head dim, value head dim]. Layer kinds as Qwen3.5's config reads them: `layer_types`,
    else every `full_attention_interval`-th layer (4) full."""
    kinds = text.get("layer_types")
    if kinds is None and "linear_num_value_heads" in text:
        every = int(text.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(int(text["num_hidden_layers"]))]
    n = sum(kind == "linear_attention" for kind in kinds or ())
    if not n:
        return 0, 0, 0
    k_heads, v_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    k_dim, v_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * int(text.get("linear_conv_kernel_dim", 4))
    return n, conv, v_heads * k_dim * v_dim


def state_bytes(layers: int, conv: int, recurrent: int, dtype_bytes: int) -> int:
    """One sequence's linear-attention state: layers × (conv state × dtype bytes + recurrent state × 4); the
    recurrent state is float32 whatever the model's dtype (transformers' delta rules compute in it)."""
    return layers * (conv * dtype_bytes + recurrent * 4)


class SizingError(ValueError):
    """A partition setting cannot be honoured (names the setting and the numbers)."""


# --------------------------------------------------------------------------- the checkpoint


@dataclass(frozen=True)
class TextGeometry:
    """What the KV pool and the activations depend on: the text model's dimensions."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    # A hybrid model's linear-attention layers, not in num_layers (the layers with K/V): linear_state_shape's
    # (layers, conv elements, recurrent elements) per sequence.
    linear_state: tuple[int, int, int] = (0, 0, 0)

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        return state_bytes(*self.linear_state, dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def block_bytes(self, block_size: int, dtype_bytes: int) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × block_size × dtype bytes: paged_attention.KVCache's."""
        return self.kv_bytes_per_token(dtype_bytes) * block_size


def text_geometry(config: dict[str, Any], where: str = "config.json") -> TextGeometry:
    """From a checkpoint's config.json (as a dict): llava's `text_config`; Qwen2-VL's top-level keys (the
    published layout) overlaid by its `text_config` (what transformers 5 saves)."""
    model_type = config.get("model_type")
    if model_type in QWEN_TYPES:
        text = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        text.update(config.get("text_config") or {})
    elif model_type in NESTED_TEXT_TYPES:
        text = dict(config.get("text_config") or {})
        text.setdefault("model_type", NESTED_TEXT_TYPES[model_type])  # the config class's default text model
    else:
        raise SizingError(f"{where}: model_type {model_type!r} is not one sizing knows "
                          f"({', '.join([*NESTED_TEXT_TYPES, *QWEN_TYPES])})")
    text_type = text.get("model_type") or model_type
    defaults = TEXT_DEFAULTS.get(text_type, {})

    def get(key: str, fallback: int | None = None) -> int:
        value = text.get(key, defaults.get(key, fallback))
        if value is None:
            raise SizingError(f"{where}: the text model ({text_type}) has no {key!r}, and sizing knows no "
                              f"default for it")
        return int(value)

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    linear = linear_state_shape(text)[0]  # layers with a state, not K/V
    return TextGeometry(model_type=str(model_type), num_layers=get("num_hidden_layers") - linear,
                        num_kv_heads=get("num_key_value_heads", heads),
                        head_dim=int(text.get("head_dim") or defaults.get("head_dim") or hidden // heads),
                        hidden_size=hidden,
                        intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                        linear_state=linear_state_shape(text))


def read_geometry(model_dir: str | os.PathLike) -> TextGeometry:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SizingError(f"{model_dir} is not a model folder: no config.json")
    return text_geometry(json.loads(path.read_text()), str(path))


def is_vision_weight(name: str) -> bool:
    return any(part in VISION_MODULES for part in name.split("."))


def parameter_counts(model_dir: str | os.PathLike) -> dict[str, int]:
    """{"vision": n, "text": n} parameters, read from the safetensors headers (no tensor is loaded)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SizingError(f"{model_dir}: sizing reads the weights' sizes from *.safetensors, and there are none")
    counts = {"vision": 0, "text": 0}
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    # Vision layers no image feature reads are never loaded (workers/vision_layers.py): not counted either.
    keep = layers_read(config.get("vision_feature_layer"),
                       (config.get("vision_config") or {}).get("num_hidden_layers", 0))
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__" or (keep is not None and (m := TOWER_LAYER.search(name)) and int(m[1]) >= keep):
                continue
            counts["vision" if is_vision_weight(name) else "text"] += math.prod(info["shape"])
    return counts


def weight_bytes(counts: dict[str, int], parts: str, dtype_bytes: int) -> int:
    """Bytes of the weights a role keeps resident, in the serving dtype."""
    kept = {"all": counts["vision"] + counts["text"], "vision": counts["vision"], "text": counts["text"]}[parts]
    return kept * dtype_bytes


# --------------------------------------------------------------------------- the formula


@dataclass(frozen=True)
class SizingPlan:
    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_bytes: int  # what the pool's blocks take
    block_bytes: int
    num_blocks: int

    def describe(self) -> str:
        if not self.num_blocks:
            return (f"budget {self.budget_bytes / GIB:.2f} GiB holds weights {self.weights_bytes / GIB:.2f} GiB + "
                    f"reserve {self.reserve_bytes / GIB:.2f} GiB (no KV pool)")
        return (f"budget {self.budget_bytes / GIB:.2f} GiB = weights {self.weights_bytes / GIB:.2f} GiB + reserve "
                f"{self.reserve_bytes / GIB:.2f} GiB + KV {self.kv_bytes / GIB:.2f} GiB "
                f"({self.num_blocks} blocks of {self.block_bytes / MIB:.3f} MiB) + gather headroom")


def reserve_bytes(geom: TextGeometry, *, dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                  workspace_bytes: int = WORKSPACE_BYTES, kv: bool = True,
                  state_snapshots: int = DEFAULT_ENGINE.state_snapshots) -> int:
    """workspace + T × (4·H + 3·I) × b + S × V × 4 × 2 + (S + snapshots) × linear state (the text terms only
    where a text model runs)."""
    if not kv:  # an encoder: the vision tower's activations are bounded by max_encode_images, in the workspace
        return workspace_bytes
    act = max_num_batched_tokens * (4 * geom.hidden_size + 3 * geom.intermediate_size) * dtype_bytes
    logits = max_num_seqs * geom.vocab_size * 4 * 2
    # A hybrid model's running sequences each hold their linear layers' state outside the pool, and its prefix
    # hits resume from copies of it (workers/linear_state.py).
    return workspace_bytes + act + logits + (max_num_seqs + state_snapshots) * geom.state_bytes_per_sequence(dtype_bytes)


def plan_blocks(*, total_bytes: int, fraction: float, weights_bytes: int, reserve: int, block_bytes: int,
                num_layers: int, min_blocks: int = 1, kv: bool = True,
                setting: str = "gpu_memory_fraction") -> SizingPlan:
    """The number of KV blocks that fit; SizingError (naming `setting`) when the share leaves no room."""
    if not 0.0 < fraction <= 1.0:
        raise SizingError(f"{setting}={fraction} must be in (0, 1]")
    budget = int(total_bytes * fraction)
    left = budget - weights_bytes - reserve
    need = f"weights {weights_bytes / GIB:.2f} GiB + reserve {reserve / GIB:.2f} GiB"
    if left < 0:
        raise SizingError(f"{setting}={fraction} of {total_bytes / GIB:.2f} GiB is {budget / GIB:.2f} GiB: it does not "
                          f"hold the {need}{', let alone a KV pool' if kv else ''}; raise {setting}, use a larger "
                          f"device or MIG profile, or lower max_num_batched_tokens / max_num_seqs")
    if not kv:
        return SizingPlan(budget, weights_bytes, reserve, 0, block_bytes, 0)
    num_blocks = int(left / (1.0 + 1.0 / num_layers)) // block_bytes
    if num_blocks < min_blocks:
        raise SizingError(f"{setting}={fraction} of {total_bytes / GIB:.2f} GiB leaves room for {num_blocks} KV blocks "
                          f"after the {need}; at least {min_blocks} are needed (one step of max_num_batched_tokens); "
                          f"raise {setting} or use a larger device or MIG profile")
    return SizingPlan(budget, weights_bytes, reserve, num_blocks * block_bytes, block_bytes, num_blocks)


def plan_for_model(model_dir: str | os.PathLike, *, total_bytes: int, fraction: float, parts: str = "text",
                   dtype_bytes: int = 2, block_size: int = DEFAULT_ENGINE.block_size,
                   max_num_batched_tokens: int = DEFAULT_ENGINE.max_num_batched_tokens,
                   max_num_seqs: int = DEFAULT_ENGINE.max_num_seqs, workspace_bytes: int = WORKSPACE_BYTES,
                   setting: str = "gpu_memory_fraction") -> SizingPlan:
    """The whole formula for one checkpoint and one role's `parts` ("vision" keeps no KV pool)."""
    geom = read_geometry(model_dir)
    kv = parts != "vision"
    return plan_blocks(
        total_bytes=total_bytes, fraction=fraction,
        weights_bytes=weight_bytes(parameter_counts(model_dir), parts, dtype_bytes),
        reserve=reserve_bytes(geom, dtype_bytes=dtype_bytes, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, workspace_bytes=workspace_bytes, kv=kv),
        block_bytes=geom.block_bytes(block_size, dtype_bytes), num_layers=geom.num_layers,
        min_blocks=max(1, math.ceil(max_num_batched_tokens / block_size)), kv=kv, setting=setting)


# --------------------------------------------------------------------------- a worker's settings


def serving_dtype_bytes(device: str, dtype: str | None, model_dir: str | None = None) -> int:
    """Bytes per element of the dtype the worker will load (common/serving_defaults.serving_dtype_for)."""
    from mserve.common.serving_defaults import serving_dtype_for

    if dtype not in (None, "auto") and dtype not in DTYPE_BYTES:
        raise SizingError(f"dtype={dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[serving_dtype_for(device, dtype, model_dir)]


def partition_worker(s: Any, parts: str) -> int:
    """Apply a worker's mig_device / gpu_memory_fraction and return its KV pool's size in blocks.

    Unset settings change nothing (`s.num_blocks` comes back). With gpu_memory_fraction on CUDA the
    device's own total memory is the base (a MIG instance reports its own slice) unless
    device_memory_gb names one, and torch's allocator is capped at the budget (the fraction of that
    memory); on CPU device_memory_gb is required (the memory to size against, e.g. the container's limit)."""
    if s.mig_device:
        from mserve.workers.mig import select_mig_device

        select_mig_device(s.mig_device, s.device)
    if s.gpu_memory_fraction is None:
        return s.num_blocks
    on_cuda = s.device.startswith("cuda")
    device_total = None
    if on_cuda:
        import torch

        index = torch.device(s.device).index or 0
        device_total = torch.cuda.get_device_properties(index).total_memory
    if s.device_memory_gb is not None:
        if s.device_memory_gb <= 0:
            raise SizingError(f"device_memory_gb={s.device_memory_gb} must be positive")
        total = int(s.device_memory_gb * GIB)
    elif device_total is not None:
        total = device_total
    else:
        raise SizingError(f"gpu_memory_fraction={s.gpu_memory_fraction} on device {s.device!r}: there is no device "
                          f"memory to take a fraction of; set device_memory_gb (the memory to size against) too, "
                          f"or unset gpu_memory_fraction and give num_blocks")
    plan = plan_for_model(s.model, total_bytes=total, fraction=s.gpu_memory_fraction, parts=parts,
                          dtype_bytes=serving_dtype_bytes(s.device, s.dtype, s.model), block_size=s.block_size,
                          max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs)
    if device_total is not None:  # the allocator's cap is the budget, whatever memory it was taken of
        torch.cuda.set_per_process_memory_fraction(min(1.0, plan.budget_bytes / device_total), index)
    log.info("gpu_memory_fraction %s of %.2f GiB: %s", s.gpu_memory_fraction, total / GIB, plan.describe())
    return plan.num_blocks if parts != "vision" else s.num_blocks


# --------------------------------------------------------------------------- planning from the shell


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mserve.workers.sizing",
                                description="How many KV blocks a worker of this checkpoint gets on a share of a GPU.")
    p.add_argument("--model", required=True, help="checkpoint folder")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--profile", help="a MIG profile, e.g. A100-80GB:1g.10gb")
    where.add_argument("--memory-gb", type=float, help="device memory in GiB")
    p.add_argument("--fraction", type=float, default=1.0, help="gpu_memory_fraction (default 1)")
    p.add_argument("--role", choices=["encode", "prefill", "decode", "unified"], default="decode")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=DEFAULT_ENGINE.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_ENGINE.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_ENGINE.max_num_seqs)
    a = p.parse_args(argv)
    from mserve.workers.mig import mig_profile

    total = mig_profile(a.profile).memory_bytes if a.profile else int(a.memory_gb * GIB)
    parts = {"encode": "vision", "unified": "all"}.get(a.role, "text")
    try:
        plan = plan_for_model(a.model, total_bytes=total, fraction=a.fraction, parts=parts,
                              dtype_bytes=DTYPE_BYTES[a.dtype], block_size=a.block_size,
                              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs)
    except SizingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"num_blocks": plan.num_blocks, "tokens": plan.num_blocks * a.block_size,
                      "summary": plan.describe()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
