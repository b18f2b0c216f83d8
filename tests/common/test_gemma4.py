"""Gemma 4's rules: prompts and counts exactly as Gemma4Processor makes them, and what is refused at load."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mserve.common.model import load_family
from mserve.common.processor import UnsupportedModelError, build_processor
from mserve.common.prompt import PromptBuilder
from tests.helpers import chat, make_frames, make_image

# (width, height): wide, tall, tiny, extreme strips, larger than the patch budget, exactly on it
SIZES = [(64, 48), (300, 200), (500, 120), (17, 301), (2000, 9), (9, 2000), (1024, 768), (72, 56), (200, 150)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["gemma4"]


@pytest.fixture(scope="module")
def hf_processor(model_dir):
    """transformers' Gemma4Processor (AutoProcessor needs torchvision for its video processor: built from parts)."""
    return build_processor(model_dir, "gemma4")


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prompt_ids_are_gemma4_processors(model_dir, hf_processor, n_images):
    """Each image token becomes <|image> + its soft tokens + <image|>, its count by its size: the ids (and the
    image groups, HF's mm_token_type_ids) equal what transformers' processor returns on the pixels."""
    builder = PromptBuilder(model_dir)
    images = [make_image(*SIZES[k + 1], seed=k) for k in range(n_images)]
    ours = builder.prepare(chat("What is in the picture?", images))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    theirs = hf_processor(text=ours.text, images=pil, add_special_tokens=False)
    assert ours.prompt_ids == theirs["input_ids"][0]
    soft = builder.family.image_token_id
    assert theirs["mm_token_type_ids"][0] == [int(t == soft) for t in ours.prompt_ids]
    assert len(builder.family.image_spans(ours.prompt_ids)) == n_images


def test_admission_count_is_the_processors_on_the_pixels(model_dir, hf_processor):
    """From the header alone, the count equals the soft tokens the processor places for the decoded image, and
    those the vision tower's image processor makes (num_soft_tokens_per_image), for sizes across the budget."""
    family = load_family(model_dir)
    soft = hf_processor.tokenizer.image_token_id
    counts = []
    for width, height in SIZES:
        image = Image.open(io.BytesIO(make_image(width, height))).convert("RGB")
        ids = hf_processor(images=[image], text=hf_processor.image_token)["input_ids"][0]
        made = hf_processor.image_processor(images=[image])["num_soft_tokens_per_image"][0]
        counts.append(family.visual_token_count((width, height)))
        assert counts[-1] == ids.count(soft) == made, (width, height)
    assert len(set(counts)) > 4 and max(counts) <= 70  # the count depends on the size, within max_soft_tokens


def test_video_is_refused_naming_the_family(model_dir):
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match="video input is not supported for model_type gemma4"):
        PromptBuilder(model_dir).prepare(video)


def settings_copy(src: Path, dst: Path, text: dict | None = None, top: dict | None = None) -> Path:
    """The checkpoint's settings files (no weights: load_family reads none), with some keys changed."""
    dst.mkdir()
    for name in ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(text or {})
    config.update(top or {})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("text, top, match", [
    ({"use_bidirectional_attention": "all"}, {}, r"use_bidirectional_attention='all'"),
], ids=["bidirectional-text"])
def test_what_is_not_served_exactly_is_refused_at_load(model_dir, tmp_path, text, top, match):
    folder = settings_copy(model_dir, tmp_path / "ckpt", text, top)
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'gemma4': this checkpoint needs " + match) as info:
        load_family(folder)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt, rate, samples", [
    ("wav", 16000, 161), ("wav", 16000, 641), ("wav", 16000, 16001), ("wav", 8000, 12345), ("wav", 44100, 30001),
    ("flac", 48000, 20000), ("mp3", 22050, 12345), ("ogg", 48000, 47000),
])
def test_audio_count_from_the_header_is_the_processors(model_dir, hf_processor, fmt, rate, samples):
    """A clip's soft tokens from its container header alone equal Gemma4Processor's count of the waveform the
    encode worker decodes (641 samples at 16 kHz: 1 token, where ceil(duration / 40 ms) would say 2), and the
    placeholder is boa + that many audio tokens + eoa."""
    from mserve.common.audio import decode_audio, read_audio_header
    from tests.audio_clips import make_audio

    family = load_family(model_dir)
    data = make_audio(samples, rate, fmt)
    info = read_audio_header(data)
    count = family.audio_token_count(info)
    clip = decode_audio(data, family.audio_features.sampling_rate, info.resampled_samples(16000))
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    text = hf_processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_processor(text=text, audio=[clip], add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
    assert count >= 1 and ids.count(family.audio_token_id) == count
    start = ids.index(family.audio_token_id) - 1
    assert ids[start:start + count + 2] == family.audio_placeholder(count)


def test_audio_tokens_are_capped_and_short_clips_give_none(model_dir):
    features = load_family(model_dir).audio_features
    assert features.tokens(160) == 0 and features.tokens(161) == 1 and round(features.min_seconds * 16000) == 161
    assert features.tokens(16000 * 40) == features.tokens(480_000) == 750  # the extractor cuts at 30 s
    assert load_family(model_dir).modalities == ["text", "image", "audio"]


def test_a_checkpoint_without_an_audio_tower_takes_no_audio(model_dir, tmp_path):
    """Gemma 4's larger checkpoints (26B-A4B, 31B) have no audio_config: images only, audio refused by name."""
    from mserve.common.audio import AudioPart
    from tests.audio_clips import make_audio

    local = tmp_path / "no-audio"
    shutil.copytree(model_dir, local)
    config = json.loads((local / "config.json").read_text())
    config["audio_config"] = None
    (local / "config.json").write_text(json.dumps(config))
    family = load_family(local)
    assert family.modalities == ["text", "image"] and family.processor.feature_extractor is None
    with pytest.raises(ValueError, match="this gemma4 checkpoint has no audio tower"):
        PromptBuilder(local).admit_audio(AudioPart(make_audio(16000)))
