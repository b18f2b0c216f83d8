"""Random-weight vision- and audio-language models built fully offline, for tests and benchmarks.

``make_tiny_model(out_dir, arch, size)`` writes a folder that looks like a published
Hugging Face checkpoint (config, safetensors weights, tokenizer, image processor, chat
template, generation config) so that serving code can be exercised end to end without
network access or real weights.  Only the weights and the vocabulary are synthetic; the
architectures, processors and chat templates are the real ones (each family's parts:
`common/tiny_families/`, one module per family).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mserve.common.tiny_families import FAMILIES
from mserve.common.tiny_families.base import VOCAB_SIZES, randomize

TINY_MODEL_ARCHS = tuple(FAMILIES)
SIZES = ("tiny", "small")

# Where the image processor's settings are written; transformers (and mserve.common.model) read
# processor_config.json's nested "image_processor" first, else preprocessor_config.json.
LAYOUTS = {
    "both": "processor_config.json with the image processor nested, plus the legacy preprocessor_config.json "
            "(and video_preprocessor_config.json for qwen2_vl); the default",
    "processor": "only what ProcessorMixin.save_pretrained writes today: the nested processor_config.json",
    "preprocessor": "the older hub layout: preprocessor_config.json; processor_config.json holds the "
                    "processor's own keys only (llava) or is absent (qwen2_vl)",
}


def _check_choice(arch: str, size: str) -> None:
    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_MODEL_ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


def make_tiny_model(out_dir: str | Path, arch: str, size: str = "tiny", seed: int = 0, layout: str = "both") -> Path:
    """Write a random-weight ``arch`` VLM checkpoint of ``size`` into ``out_dir``; return it.

    ``layout`` picks where the image processor's settings go (see ``LAYOUTS``)."""
    import transformers

    _check_choice(arch, size)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {tuple(LAYOUTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        (out / name).unlink(missing_ok=True)  # a rebuilt folder holds exactly the layout's files
    family = FAMILIES[arch]
    dims, std = family.dims[size], family.init_std[size]
    tok = family.tokenizer(VOCAB_SIZES[size])
    config = family.config(dims, tok, std)
    family.save_processor(out, dims, tok, layout)

    model = getattr(transformers, family.model_class).from_config(config, dtype=torch.float32)
    randomize(model, std, seed)
    model.generation_config = family.generation_config(tok)
    model.save_pretrained(out)
    return out
