"""A model type the generic path cannot serve exactly is refused at load, with one line naming what it lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mserve.common.model import load_family
from mserve.common.processor import UnsupportedModelError


def config_only(root: Path, model_type: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type, "image_token_id": 3}))
    return root


@pytest.mark.parametrize("model_type, match", [
    ("idefics", r"'idefics': IdeficsProcessor has no _get_num_multimodal_tokens, so the visual-token count"),
    ("not_a_vlm", r"'not_a_vlm': transformers has no processor class for it"),
    ("paligemma", r"'paligemma': prefix-LM attention \(bidirectional over the whole prompt, from token_type_ids\): "
                  r"not supported"),
], ids=["no-count-hook", "unknown", "untested-trait"])
def test_unservable_model_type_is_refused_at_load_in_one_line(tmp_path, model_type, match):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        load_family(config_only(tmp_path, model_type))
    assert "\n" not in str(info.value)


def test_known_gap_is_named_at_load(tmp_path, monkeypatch):
    from mserve.common import served_models

    monkeypatch.setitem(served_models.KNOWN_GAPS, "paligemma", "what the test says is missing")
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'paligemma' needs what the test says is missing$"):
        load_family(config_only(tmp_path, "paligemma"))


def test_engine_refuses_before_loading_weights(tmp_path):
    """The worker's runner loads the family first: no weights are read for a refused model type."""
    from mserve.workers.model_runner import ModelRunner

    with pytest.raises(UnsupportedModelError, match="paligemma"):
        ModelRunner(config_only(tmp_path, "paligemma"))


def test_video_to_a_family_without_video_support_is_refused_naming_it():
    """A family with a video token whose video path is not verified is refused at admission, naming it."""
    from mserve.common.model import ModelFamily

    family = ModelFamily(model_type="some_vl", image_token_id=1, text_config={}, processor_config={},
                         vision_config={}, video_token_id=2, video_config={})
    assert family.video_unsupported() == ("video input is not supported for model_type some_vl (video is served "
                                          "for qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe and the families that take frames as images)")


def test_qwen2_5_vl_takes_video(tiny_model_dirs):
    from mserve.common.prompt import PromptBuilder
    from tests.helpers import make_frames

    builder = PromptBuilder(tiny_model_dirs["qwen2_5_vl"])
    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2), "fps": 1},
                                          {"type": "text", "text": "What happens?"}]}]
    pp = builder.prepare(video)
    assert pp.images[0].fps == 1.0 and pp.prompt_ids.count(builder.family.video_token_id) == 4
    with pytest.raises(ValueError, match="video part fps must be a number of frames per second over 0, got 0"):
        builder.prepare([{"role": "user", "content": [{**video[0]["content"][0], "fps": 0}]}])


def test_mserve_up_refuses_before_starting_anything(tmp_path, caplog):
    from mserve.up import _main

    assert _main(["--model", str(config_only(tmp_path, "paligemma"))]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith("mserve up failed: model_type 'paligemma': prefix-LM attention")
