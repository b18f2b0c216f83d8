"""The families `mserve make-tiny-model` builds: one module per family, each a `TinyFamily`.

A new family is a module here (its config, processor files, tokenizer and chat template, saved the
way current transformers saves them) and one entry in FAMILIES; `common/tiny_model.py` trains the
tokenizer, draws the weights and saves the folder the same way for all of them.
"""

from __future__ import annotations

from mserve.common.tiny_families.base import TinyFamily
from mserve.common.tiny_families.gemma3 import GEMMA3
from mserve.common.tiny_families.glm4v import GLM4V, GLM4V_MOE, GLM46V
from mserve.common.tiny_families.gemma4 import GEMMA4
from mserve.common.tiny_families.internvl import INTERNVL
from mserve.common.tiny_families.llama4 import LLAMA4
from mserve.common.tiny_families.llava import LLAVA, LLAVA_NEXT
from mserve.common.tiny_families.mistral3 import MISTRAL3
from mserve.common.tiny_families.qwen import QWEN2_5_VL, QWEN2_VL
from mserve.common.tiny_families.qwen2_audio import QWEN2_AUDIO
from mserve.common.tiny_families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from mserve.common.tiny_families.qwen3_vl import QWEN3_VL, QWEN3_VL_MOE
from mserve.common.tiny_families.smolvlm import IDEFICS3, SMOLVLM
from mserve.common.tiny_families.voxtral import VOXTRAL

FAMILIES: dict[str, TinyFamily] = {f.arch: f for f in (LLAVA, QWEN2_VL, LLAVA_NEXT, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, MISTRAL3, GEMMA3, GEMMA4,
                                                  INTERNVL, SMOLVLM, IDEFICS3, GLM46V, GLM4V,
                                                  GLM4V_MOE, QWEN3_5, QWEN3_5_MOE, QWEN2_AUDIO, VOXTRAL, LLAMA4)}
# Families that take audio (and no image): their folders hold a feature extractor, no image processor.
AUDIO_ARCHS = ("qwen2_audio", "voxtral")
# Families served for text only: their folders hold the image processor's settings, but its class needs
# torchvision (common/families/llama4.py).
TEXT_ONLY_ARCHS = ("llama4",)
