"""`mserve make-tiny-model --arch qwen2_audio`: the folder loads offline with transformers' own classes,
its processor expands the audio token by Qwen2-Audio's arithmetic, and greedy generation is not degenerate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mserve.common.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return make_tiny_model(tmp_path_factory.mktemp("qwen2_audio"), "qwen2_audio", "tiny", seed=0)


@pytest.fixture(scope="module")
def loaded(folder):
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    return AutoProcessor.from_pretrained(folder), AutoModelForMultimodalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompt(processor, clips: int = 1) -> str:
    content = [{"type": "audio", "audio_url": "clip"}] * clips + [{"type": "text", "text": "What is this sound?"}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def test_folder_is_a_qwen2_audio_checkpoint(folder, loaded):
    processor, model = loaded
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert (folder / "preprocessor_config.json").is_file() and (folder / "chat_template.jinja").is_file()
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    tok = processor.tokenizer
    assert config["audio_token_index"] == tok.convert_tokens_to_ids("<|AUDIO|>") == processor.audio_token_id
    # The tower's positions cover exactly the feature extractor's window after the stride-2 conv.
    fe = processor.feature_extractor
    assert model.config.audio_config.max_source_positions * 2 == fe.nb_max_frames
    assert model.config.audio_config.num_mel_bins == fe.feature_size
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in _prompt(processor)


def test_greedy_generation_is_not_degenerate(loaded):
    processor, model = loaded
    clip = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    inputs = processor(text=_prompt(processor), audio=[clip], sampling_rate=16000, return_tensors="pt")
    assert int((inputs["input_ids"] == processor.audio_token_id).sum()) == 25  # 100 frames -> 50 -> 25
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) == 12 and len(set(new)) >= 3, new


def test_same_seed_same_bytes(folder, tmp_path):
    again = make_tiny_model(tmp_path / "again", "qwen2_audio", "tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
