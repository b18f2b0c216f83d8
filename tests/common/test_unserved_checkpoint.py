"""A real checkpoint of a VLM type mserve does not serve is refused at load, in one line naming what is
missing, wherever it is loaded: load_family, `mserve worker` (exit status, no traceback) and `mserve up`.

The checkpoints are built offline from tiny transformers configs of other VLM types: PaliGemma (its
prefix-LM attention, read from the checkpoint: common/traits.py) and LLaVA-OneVision (a known gap: a multi-image prompt takes each image at its
base view only, so an image's token count depends on the other images in its prompt, while its
processor's _get_num_multimodal_tokens counts every image with its any-res tiles).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mserve.common.model import load_family

from mserve.common.served_models import KNOWN_GAPS
from mserve.common.processor import UnsupportedModelError

UNVERIFIED = ("model_type 'paligemma': prefix-LM attention (bidirectional over the whole prompt, from "
              "token_type_ids): not supported; bidirectional text attention (use_bidirectional_attention): not supported")


def _save(config, out: Path) -> Path:
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    return out


def _vision():
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory) -> Path:
    from transformers import GemmaConfig, PaliGemmaConfig

    text = GemmaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    return _save(PaliGemmaConfig(vision_config=_vision(), text_config=text, image_token_index=257,
                                 projection_dim=64), tmp_path_factory.mktemp("paligemma"))


@pytest.fixture(scope="module")
def llava_onevision(tmp_path_factory) -> Path:
    from transformers import LlavaOnevisionConfig, Qwen2Config

    text = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    config = LlavaOnevisionConfig(vision_config=_vision(), text_config=text, image_token_index=290,
                                  video_token_index=291, image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]])
    return _save(config, tmp_path_factory.mktemp("llava_onevision"))


def test_load_family_refuses_in_one_line(paligemma, llava_onevision):
    with pytest.raises(UnsupportedModelError) as info:
        load_family(paligemma)
    assert str(info.value) == UNVERIFIED
    with pytest.raises(UnsupportedModelError) as info:
        load_family(llava_onevision)
    assert str(info.value) == f"model_type 'llava_onevision' needs {KNOWN_GAPS['llava_onevision']}"
    assert "\n" not in KNOWN_GAPS["llava_onevision"]


def test_worker_cli_exits_with_one_error_line(paligemma):
    """Refused before connecting anywhere or reading a weight: the coordinator address is never dialled."""
    proc = subprocess.run([sys.executable, "-m", "mserve.cli", "worker", "--role", "unified", "--model",
                           str(paligemma), "--coordinator", "tcp://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.split(" ")[2:3] == ["INFO"]]
    assert errors == [f"error: {UNVERIFIED}"]


def test_mserve_up_refuses_before_starting_anything(paligemma, caplog):
    from mserve.up import _main

    assert _main(["--model", str(paligemma)]) == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [f"mserve up failed: {UNVERIFIED}"]
