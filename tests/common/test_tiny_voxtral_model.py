"""`mserve make-tiny-model --arch voxtral`: a Tekken tokenizer written offline that transformers' own
VoxtralProcessor and mistral_common take (control tokens at the published ranks), and a load that refuses a
tower whose rows per chunk are not the tokenizer's count."""

from __future__ import annotations

import json
import shutil

import pytest

from mserve.common.checkpoint_files import CheckpointError
from mserve.common.model import load_family


def test_folder_is_a_voxtral_checkpoint(tiny_model_dirs):
    from transformers import AutoProcessor

    folder = tiny_model_dirs["voxtral"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["VoxtralForConditionalGeneration"]
    processor = AutoProcessor.from_pretrained(folder)
    assert type(processor.tokenizer).__name__ == "MistralCommonBackend"
    ranks = {t["token_str"]: t["rank"] for t in json.loads((folder / "tekken.json").read_text())["special_tokens"]}
    assert (ranks["[AUDIO]"], ranks["[BEGIN_AUDIO]"], ranks["[TRANSCRIBE]"]) == (24, 25, 34)
    assert config["audio_token_id"] == processor.audio_token_id == 24
    family = load_family(folder)
    assert family.modalities == ["text", "audio"] and family.audio_features.tokens(1) == 375


def test_a_tower_that_disagrees_with_the_tokenizer_is_refused_at_load(tiny_model_dirs, tmp_path):
    folder = shutil.copytree(tiny_model_dirs["voxtral"], tmp_path / "vox", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["audio_config"]["intermediate_size"] *= 2  # 8 frames a token: 187 rows a chunk, the tokenizer says 375
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="gives 187 rows per chunk, tekken.json's audio settings 375 tokens"):
        load_family(folder)
