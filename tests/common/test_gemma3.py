"""Gemma 3's rules: prompts and counts exactly as Gemma3Processor makes them, and what is refused at load."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mserve.common.model import load_family
from mserve.common.processor import UnsupportedModelError
from mserve.common.prompt import PromptBuilder
from tests.helpers import chat, make_frames, make_image

SIZES = [(64, 48), (300, 200), (500, 120), (17, 301)]  # (width, height)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["gemma3"]


@pytest.fixture(scope="module")
def hf_processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prompt_ids_are_gemma3_processors(model_dir, hf_processor, n_images):
    """Each <start_of_image> becomes "\\n\\n" + boi + soft tokens + eoi + "\\n\\n" as text, then tokenized:
    the ids (and the image groups, HF's token_type_ids) equal what transformers' processor returns."""
    builder = PromptBuilder(model_dir)
    images = [make_image(*SIZES[k], seed=k) for k in range(n_images)]
    ours = builder.prepare(chat("What is in the picture?", images))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    theirs = hf_processor(text=ours.text, images=pil, add_special_tokens=False)
    assert ours.prompt_ids == theirs["input_ids"][0]
    soft = builder.family.image_token_id
    assert theirs["token_type_ids"][0] == [int(t == soft) for t in ours.prompt_ids]
    assert [n for _, n in builder.family.image_spans(ours.prompt_ids)] == [16] * n_images


def test_admission_count_is_the_processors(model_dir, hf_processor):
    family = load_family(model_dir)
    for width, height in SIZES:
        image = Image.open(io.BytesIO(make_image(width, height))).convert("RGB")
        ids = hf_processor(images=[image], text=hf_processor.image_token)["input_ids"][0]
        soft = hf_processor.tokenizer.image_token_id  # the processor's own image_token_id is boi
        assert family.visual_token_count((width, height)) == ids.count(soft) == 16


def test_video_is_refused_naming_the_family(model_dir):
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match="video input is not supported for model_type gemma3"):
        PromptBuilder(model_dir).prepare(video)


def settings_copy(src: Path, dst: Path, text: dict | None = None, image_processor: dict | None = None) -> Path:
    """The checkpoint's settings files (no weights: load_family reads none), with some keys changed."""
    dst.mkdir()
    for name in ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(text or {})
    (dst / "config.json").write_text(json.dumps(config))
    proc = json.loads((dst / "processor_config.json").read_text())
    proc["image_processor"].update(image_processor or {})
    (dst / "processor_config.json").write_text(json.dumps(proc))
    return dst


@pytest.mark.parametrize("text, image_processor, match", [
    ({}, {"do_pan_and_scan": True}, r"pan-and-scan \(do_pan_and_scan\)"),
    ({"attn_logit_softcapping": 50.0}, {}, r"attn_logit_softcapping \(the paged attention"),
    ({"final_logit_softcapping": 30.0}, {}, r"final_logit_softcapping"),
    ({"use_bidirectional_attention": True}, {}, r"use_bidirectional_attention"),
], ids=["pan-and-scan", "attn-softcap", "final-softcap", "bidirectional-text"])
def test_what_cannot_be_served_exactly_is_refused_at_load(model_dir, tmp_path, text, image_processor, match):
    folder = settings_copy(model_dir, tmp_path / "ckpt", text, image_processor)
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'gemma3': .* uses " + match) as info:
        load_family(folder)
    assert "\n" not in str(info.value)
