"""Vision layers no image feature reads are dropped at load, and the features stay the very same tensors."""

from __future__ import annotations

import io

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from mserve.common.model import load_family
from mserve.workers.model_loading import load_vlm
from mserve.workers.vision_layers import layers_read
from tests.helpers import make_image


def test_llava_runs_its_tower_up_to_the_feature_layer_only(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llava"])
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    trimmed = load_vlm(model_dir, dtype="float32")
    n = len(full.model.vision_tower.encoder.layers)
    assert full.config.vision_feature_layer == -2  # LLaVA-1.5's penultimate layer
    assert len(trimmed.model.vision_tower.encoder.layers) == n - 1
    assert trimmed.config.vision_feature_layer == n - 1  # the same hidden state, counted from the front
    image = Image.open(io.BytesIO(make_image(300, 200, seed=3))).convert("RGB")
    pixels = load_family(model_dir).image_inputs([image])["pixel_values"]
    with torch.inference_mode():
        want = full.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        got = trimmed.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_tower_whose_last_layer_is_read_keeps_every_layer(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["mistral3"])  # Pixtral: vision_feature_layer -1
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    trimmed = load_vlm(model_dir, dtype="float32")
    assert trimmed.config.vision_feature_layer == full.config.vision_feature_layer
    assert sum(p.numel() for p in trimmed.parameters()) == sum(p.numel() for p in full.parameters())


def test_layers_read_counts_from_the_front():
    assert layers_read(-2, 24) == 23  # LLaVA-1.5: the penultimate layer's output, 23 layers run
    assert layers_read([-2, -5, 8], 24) == 23  # several hidden states: up to the deepest one
    assert layers_read(12, 24) == 12
    assert layers_read(-1, 24) is None and layers_read(24, 24) is None  # the last layer is read: all run
    assert layers_read(None, 24) is None and layers_read(-2, 0) is None  # nothing to go by: all run
