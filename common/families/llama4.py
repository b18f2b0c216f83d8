"""Llama 4's own rules: its text path is served, its images are not.

The text model's traits (chunked local attention on the RoPE layers, temperature-tuned global NoPE layers,
the qk L2 norm, sigmoid-routed experts beside a shared expert) run in the engine token-exact
(workers/text_traits.py, workers/paged_attention.py; tests/workers/test_engine_llama4.py). Its images
are tiled by Llama4ImageProcessor, whose only backend in transformers is torchvision, which mserve does
not install: no image could be prepared as HF prepares it, so image and video parts are refused at
admission, and the processor is built without an image processor (the tokenizer and chat template serve
text). No torch here: admission uses this.
"""

from __future__ import annotations

from mserve.common.families import FamilyRules

MODEL_TYPE = "llama4"

NO_IMAGES = (f"model_type {MODEL_TYPE} is served for text only: its image processor (Llama4ImageProcessor) needs "
             "torchvision, which this build of mserve does not install")

RULES = FamilyRules(no_images=NO_IMAGES, no_video=NO_IMAGES,
                    # its chunked local attention layers (workers/attention_masks.py: local_keys)
                    honoured_traits=frozenset({"chunked_attention"}),
                    # Measured on the tiny model: in bfloat16 HF's own top-2 logits tie within rounding at the first
                    # steps of most prompts, so no comparison here reaches far enough to prove the tokens.
                    float32_only="its bfloat16 / float16 tokens are not verified against HF generate's in that dtype "
                                 "(no test here proves them: the tiny model's bf16 logits tie within rounding)")
