"""What a server runs when the user names nothing: the model's dtype and the roles of a local cluster.

Pure Python (no torch): the worker (workers/model_runner.py), KV sizing (workers/sizing.py) and
`mserve up` read these same rules, so the dtype a worker loads and the one its pool is sized for,
or the roles `mserve up` prints and the ones it starts, cannot disagree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
# CPU flags of native bfloat16 arithmetic (AVX512_BF16's dot products, AMX's bf16 tiles): where either
# is present, oneDNN's bf16 matrix multiplies run at about twice float32's rate; elsewhere torch
# emulates them (6x slower than float32 on an AVX2-only EPYC, bench/lab/NOTEBOOK.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX-BF16)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_CPU_FLAGS)


def checkpoint_dtype(model_dir: str | os.PathLike) -> str | None:
    """The dtype the checkpoint's config.json says its weights are in (`dtype`, or transformers 4's
    `torch_dtype`, top level or the text config's), or None."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if value in DTYPES:
            return value
    return None


def serving_dtype(device: str, requested: str | None, checkpoint: str | None,
                  native_bf16: bool | None = None) -> str:
    """The dtype a worker runs its model in.

    A dtype the user names wins. Otherwise ("auto"): on a GPU, the checkpoint's reduced precision
    (bfloat16 for a float32 checkpoint); on a CPU with native bfloat16, bfloat16 whatever the
    checkpoint was saved in (float16 has no fast CPU kernels, and a float32 checkpoint is cast as
    vLLM's `--dtype auto` casts it on such a CPU); on any other CPU, float32, the fast choice there.
    bfloat16 serves HF bf16's greedy tokens except after a step where HF's own top-2 logits are
    within bf16 rounding (common/exactness.py); float32 is bitwise HF's."""
    if requested not in (None, "auto"):
        if requested not in DTYPES:
            raise ValueError(f"dtype={requested!r}: one of auto, {', '.join(DTYPES)}")
        return requested
    if device.startswith("cuda"):
        return checkpoint if checkpoint in ("bfloat16", "float16") else "bfloat16"
    return "bfloat16" if (cpu_native_bf16() if native_bf16 is None else native_bf16) else "float32"


def serving_dtype_for(device: str, requested: str | None, model_dir: str | os.PathLike | None) -> str:
    """serving_dtype for one checkpoint: its saved dtype, and float32 when auto meets a family whose
    reduced-precision tokens are not verified (FamilyRules.float32_only): the default never picks a dtype
    the checkpoint would be refused in; a dtype the user names is theirs (and refused at load with why)."""
    dtype = serving_dtype(device, requested, checkpoint_dtype(model_dir) if model_dir is not None else None)
    if requested in (None, "auto") and dtype != "float32" and model_dir is not None:
        from mserve.common.families import rules_for

        try:
            model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return dtype
        if rules_for(model_type).float32_only is not None:
            return "float32"
    return dtype


# -- the roles of a local cluster -------------------------------------------------------------------

# Unified workers per host, at most, when the user names no roles: past this each worker gets more
# threads instead of more workers joining (every worker holds the whole model's weights).
MAX_DEFAULT_UNIFIED = 8


@dataclass(frozen=True)
class Layout:
    """The role counts and threads per worker `mserve up` starts, and why, in words a log line can hold."""

    encode: int
    prefill: int
    decode: int
    unified: int
    threads: int
    why: str

    def describe(self) -> str:
        roles = (f"unified:{self.unified}" if self.unified and not (self.encode or self.prefill or self.decode)
                 else f"{self.encode}e{self.prefill}p{self.decode}d" + (f"+unified:{self.unified}" if self.unified else ""))
        return f"{roles}, {self.threads} thread(s) each ({self.why})"


def default_layout(cores: int, gpus: int = 0) -> Layout:
    """The roles for a host when the user names none: unified workers, one per GPU, else one per core
    (at most MAX_DEFAULT_UNIFIED, the cores shared out as threads).

    Measured beside vLLM-CPU on two cores (bench/lab/NOTEBOOK.md), `unified:2` led every trace: 1.78x vLLM's
    image throughput with TTFT p99 0.50x, where `1e1p1d` gave 1.52x with p99 1.64x. Separate pools
    pay where each stage has hardware of its own to fill and the load mix is known; name the roles
    (--encode/--prefill/--decode) for that."""
    if gpus > 0:
        return Layout(0, 0, 0, gpus, 1, f"one unified worker per GPU, {gpus} GPU(s)")
    cores = max(1, cores)
    workers = min(cores, MAX_DEFAULT_UNIFIED)
    return Layout(0, 0, 0, workers, max(1, cores // workers),
                  f"one unified worker per core on {cores} core(s)" if workers == cores
                  else f"{workers} unified workers sharing {cores} cores")


# -- the flags that choose them -------------------------------------------------------------------------

def add_dtype_arguments(parser, who: str = "the model") -> None:  # noqa: ANN001 - an argparse parser
    """--dtype and --attention, with one help text for `mserve generate`, `mserve worker` and `mserve up`."""
    parser.add_argument("--dtype", default=None, choices=["auto", *DTYPES],
                        help=f"{who}'s dtype (default auto: bfloat16 on a CPU with native bfloat16 (AVX512_BF16 or "
                             "AMX), float32 on any other CPU, the checkpoint's bfloat16 / float16 on a GPU). float32 "
                             "gives HF generate's tokens bit for bit; bfloat16 gives HF bf16's except after a step "
                             "where HF's own top-2 logits are within bf16 rounding (docs/operations.md)")
    parser.add_argument("--attention", default=None, choices=["auto", "exact", "padded"],
                        help="auto (default) = padded: one attention call per batch and, on the CPU, the kernels "
                             "that read the bf16 pool in place; exact: each request over exactly its own keys, one "
                             "call per context length, HF bf16's bits even at its ties, several times slower")
