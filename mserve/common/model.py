"""Loads a local VLM checkpoint and knows each family's rules: visual token counts, placeholders, positions.

Everything model-specific that the coordinator (no tensors) and the workers (tensors) both need
lives in one `ModelFamily` per architecture, so admission and the engine can never disagree on
how many placeholder tokens an image becomes.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from PIL import Image

SUPPORTED_MODEL_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl")


class ImageError(ValueError):
    """An image the user sent cannot be used (corrupt, unsupported, over a limit)."""


def image_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def image_size_from_header(data: bytes) -> tuple[int, int]:
    """(width, height) read from the header only: PIL's open() does not decode pixels."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception as exc:  # PIL raises many types for bad input
        raise ImageError(f"cannot read image header: {exc.__class__.__name__}: {exc}") from exc


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Decode image bytes to RGB, checking the pixel limit before any pixel is decoded."""
    width, height = image_size_from_header(data)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the limit max_image_pixels={max_pixels}")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except Exception as exc:
        raise ImageError(f"cannot decode image ({width}x{height}): {exc.__class__.__name__}: {exc}") from exc


def read_model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder: no config.json")
    return json.loads(path.read_text())


@dataclass
class ModelFamily:
    """The per-architecture rules, built from a checkpoint's config files alone (no weights)."""

    model_type: str
    image_token_id: int
    text_config: dict[str, Any]
    processor_config: dict[str, Any]
    vision_config: dict[str, Any]

    @property
    def uses_mrope(self) -> bool:
        return self.model_type in ("qwen2_vl", "qwen2_5_vl")

    def visual_token_count(self, image_size: tuple[int, int]) -> int:
        """Exact number of placeholder tokens one image of (width, height) becomes."""
        width, height = image_size
        if self.uses_mrope:
            grid_h, grid_w = self.qwen_grid(width, height)
            merge = self.processor_config.get("merge_size", 2)
            return grid_h * grid_w // (merge * merge)
        return self.llava_tokens_per_image

    @property
    def llava_tokens_per_image(self) -> int:
        crop = self.processor_config.get("crop_size") or self.processor_config.get("size") or {}
        if isinstance(crop, int):
            h = w = crop
        else:
            h = crop.get("height", crop.get("shortest_edge"))
            w = crop.get("width", crop.get("shortest_edge"))
        patch = self.vision_config.get("patch_size", 14)
        n = (h // patch) * (w // patch)
        # CLIP adds a CLS token; the "default" strategy drops it again.
        return n + 1 - 1 if self.vision_feature_select_strategy == "default" else n + 1

    @property
    def vision_feature_select_strategy(self) -> str:
        return self.processor_config.get("vision_feature_select_strategy", "default")

    def qwen_grid(self, width: int, height: int) -> tuple[int, int]:
        """Patch grid (h, w) after Qwen2-VL's smart_resize."""
        cfg = self.processor_config
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        patch = cfg.get("patch_size", 14)
        factor = patch * cfg.get("merge_size", 2)
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"image aspect ratio {width}x{height} is over 200:1")
        # Same arithmetic as transformers' smart_resize (kept here so the coordinator needs no torch).
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > max_pixels:
            beta = math.sqrt((height * width) / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar // patch, w_bar // patch

    def expand_placeholders(self, token_ids: Sequence[int], image_sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Replace each image token by as many copies as that image has visual tokens."""
        out: list[int] = []
        images = iter(image_sizes)
        for tok in token_ids:
            if tok == self.image_token_id:
                size = next(images, None)
                if size is None:
                    raise ValueError("prompt has more image placeholders than images")
                out.extend([tok] * self.visual_token_count(size))
            else:
                out.append(tok)
        if next(images, None) is not None:
            raise ValueError("prompt has fewer image placeholders than images")
        return out

    def image_spans(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of image placeholder tokens, in order."""
        spans: list[tuple[int, int]] = []
        i, n = 0, len(token_ids)
        while i < n:
            if token_ids[i] == self.image_token_id:
                j = i
                while j < n and token_ids[j] == self.image_token_id:
                    j += 1
                spans.append((i, j - i))
                i = j
            else:
                i += 1
        return spans


def load_family(model_dir: str | os.PathLike) -> ModelFamily:
    cfg = read_model_config(model_dir)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {model_dir}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    proc_path = Path(model_dir) / "preprocessor_config.json"
    proc = json.loads(proc_path.read_text()) if proc_path.is_file() else {}
    # llava-hf keeps the select strategy in processor_config.json / config.json, not the image processor.
    for extra in ("processor_config.json",):
        p = Path(model_dir) / extra
        if p.is_file():
            for k, v in json.loads(p.read_text()).items():
                proc.setdefault(k, v)
    proc.setdefault("vision_feature_select_strategy", cfg.get("vision_feature_select_strategy", "default"))
    image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    if image_token_id is None:
        raise ValueError(f"{model_dir}/config.json has no image_token_id")
    return ModelFamily(
        model_type=model_type,
        image_token_id=int(image_token_id),
        text_config=cfg.get("text_config", {}),
        processor_config=proc,
        vision_config=cfg.get("vision_config", {}),
    )
