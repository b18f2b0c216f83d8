"""Test factories: images, prompts, and the Hugging Face `generate` oracle every greedy path must match."""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
from PIL import Image


def make_image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A deterministic image: a smooth gradient plus seeded noise, so different seeds embed differently."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = np.clip(base * 0.75 + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


PROMPTS = [
    "Describe the picture.",
    "What is in this image? Answer in one short sentence please.",
    "List three colours you can see, and say which one covers the largest area of the image.",
    "Hi",
    "Tell me a story about a small robot who learns to paint landscapes near the sea at dawn.",
    "Compare the two halves of the image.",
    "Is this a photograph or a drawing?",
    "Count the objects.",
    "Write a haiku about it.",
    "What would you change to make it brighter, warmer and more inviting to look at?",
]


@lru_cache(maxsize=4)
def reference_model(model_dir: str):
    """A separate, untouched copy of the checkpoint for Hugging Face generate()."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return model, processor


def hf_generate(model_dir: str, prompt_ids: Sequence[int], images: Sequence[bytes], max_new_tokens: int,
                ignore_eos: bool = False) -> list[int]:
    """Greedy token ids from transformers' own generate() on the same prompt ids and images.

    ignore_eos: EOS does not stop generation (it can still be picked), as in vLLM and our engine.
    """
    return list(_hf_generate(str(model_dir), tuple(prompt_ids), tuple(images), max_new_tokens, ignore_eos))


@lru_cache(maxsize=1024)
def _hf_generate(model_dir: str, prompt_ids: tuple[int, ...], images: tuple[bytes, ...], max_new_tokens: int,
                 ignore_eos: bool):
    import copy

    model, processor = reference_model(model_dir)
    ids = torch.tensor([list(prompt_ids)])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        inputs = processor(images=pil, return_tensors="pt")
        kwargs["pixel_values"] = inputs["pixel_values"]
        if "image_grid_thw" in inputs:
            kwargs["image_grid_thw"] = inputs["image_grid_thw"]
    if model.config.model_type in ("qwen2_vl", "qwen2_5_vl"):
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    if ignore_eos:
        config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(**kwargs, generation_config=config)
    return tuple(out[0, ids.shape[1]:].tolist())


def chat(text: str, images: Sequence[bytes] = ()) -> list[dict]:
    """One user turn in the OpenAI shape: images first, then the text."""
    return [{"role": "user", "content": [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]}]


def request_mix(n: int, seed: int = 0) -> list[tuple[str, list[bytes]]]:
    """n (text, images) pairs cycling text-only, one image and two images, of varied sizes."""
    mix = []
    for i in range(n):
        k = i % 3
        images = [make_image(96 + 53 * ((i + j) % 7), 80 + 41 * ((i * 3 + j) % 5), seed=seed * 1000 + 10 * i + j)
                  for j in range(k)]
        mix.append((PROMPTS[i % len(PROMPTS)], images))
    return mix
