"""Video rules checked against transformers' own code: token counts, settings lookup, patch layout.

transformers' Qwen2VLVideoProcessor module imports torchvision at its top, which is not installed here.
Its `patchify` and `get_num_of_video_patches` use torch only, so the module is imported once with a stub
standing in for torchvision.transforms.v2.functional (never called), and those two are called directly.
"""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mserve.common.model import VideoInfo, load_family
from mserve.common.video import VideoError, VideoPart, describe_video, sample_indices, video_part_from_value
from mserve.workers.video_processing import qwen_video_inputs, temporal_patches
from tests.helpers import import_without_torchvision, make_frames, make_image


@pytest.fixture(scope="module")
def qwen(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen2_vl"])


@pytest.fixture(scope="module")
def image_processor(qwen):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(qwen, backend="pil")


@pytest.fixture(scope="module")
def hf_video_module():
    """transformers.models.qwen2_vl.video_processing_qwen2_vl, imported with torchvision stubbed out."""
    return import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")


@pytest.mark.parametrize("num_frames", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("size", [(120, 90), (33, 640), (1920, 1080), (56, 56)])
def test_token_count_matches_transformers_video_processor(qwen, hf_video_module, num_frames, size):
    family = load_family(qwen)
    cfg = family.video_config
    settings = {"size": {"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]},
                "patch_size": cfg["patch_size"], "merge_size": cfg["merge_size"],
                "temporal_patch_size": cfg["temporal_patch_size"]}
    # The processor's settings as attributes (transformers < 5.25 reads those) and as the merged
    # kwargs newer versions read through _merge_and_standardize_kwargs.
    proc = SimpleNamespace(**settings, _merge_and_standardize_kwargs=lambda **kw: {**settings, **kw})
    patches = hf_video_module.Qwen2VLVideoProcessor.get_num_of_video_patches(proc, num_frames, size[1], size[0], {})
    info = VideoInfo(num_frames, *size)
    assert family.video_token_count(info) * cfg["merge_size"] ** 2 == patches
    t, h, w = family.video_grid(info)
    assert t * h * w == patches and t == -(-num_frames // 2)


def test_video_settings_come_from_where_transformers_reads_them(qwen, tmp_path):
    from transformers.video_processing_utils import BaseVideoProcessor

    theirs, _ = BaseVideoProcessor.get_video_processor_dict(qwen)
    family = load_family(qwen)
    assert family.video_config["min_pixels"] == theirs["size"]["shortest_edge"]
    assert family.video_config["max_pixels"] == theirs["size"]["longest_edge"]
    assert family.video_token_id is not None and family.video_token_id != family.image_token_id
    # Only an image preprocessor_config.json (the hub's Qwen2-VL layout): the video processor reads it,
    # its min_pixels / max_pixels overriding the video class defaults.
    import json
    import shutil

    d = tmp_path / "hub"
    shutil.copytree(qwen, d)
    for name in ("processor_config.json", "video_preprocessor_config.json"):
        (d / name).unlink(missing_ok=True)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre.update(min_pixels=3136, max_pixels=12845056)
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    theirs, _ = BaseVideoProcessor.get_video_processor_dict(str(d))
    assert theirs["max_pixels"] == load_family(d).video_config["max_pixels"] == 12845056
    assert load_family(d).video_config["temporal_patch_size"] == 2


@pytest.mark.parametrize("num_frames", [2, 3, 4, 5])
def test_temporal_layout_equals_transformers_patchify(image_processor, hf_video_module, num_frames):
    """Normalized frames patchified one by one as images, then grouped by temporal_patch_size, equal the
    video processor's own patchify of the stacked frames (odd counts padded with the last frame)."""
    rng = np.random.default_rng(num_frames)
    frames = rng.standard_normal((num_frames, 3, 56, 84)).astype(np.float32)
    per_frame = np.concatenate([image_processor.patchify(f, patch_size=14, merge_size=2, temporal_patch_size=2)[0]
                                for f in frames])
    ours, t = temporal_patches(per_frame, num_frames, 3, 2, 14)
    theirs, grid_t, grid_h, grid_w = hf_video_module.Qwen2VLVideoProcessor.patchify(
        None, torch.from_numpy(frames)[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (t, 4, 6) == (grid_t, grid_h, grid_w)
    assert np.array_equal(ours, theirs[0].numpy())


def test_two_identical_frames_equal_the_image_processor(qwen, image_processor):
    """A video of one frame twice is, by the model's definition, that image: the image processor repeats
    an image over the temporal slots."""
    family = load_family(qwen)
    img = Image.open(io.BytesIO(make_image(150, 100, seed=2))).convert("RGB")
    video = qwen_video_inputs(image_processor, family, [[img, img]])
    image = image_processor(images=[img], return_tensors="pt")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])


def test_frames_differ_per_temporal_slot(qwen, image_processor):
    family = load_family(qwen)
    frames = [Image.open(io.BytesIO(b)).convert("RGB") for b in make_frames(120, 90, 3, seed=1)]
    out = qwen_video_inputs(image_processor, family, [frames])
    t, h, w = out["video_grid_thw"][0].tolist()
    assert (t, h, w) == family.video_grid(VideoInfo(3, 120, 90))
    x = out["pixel_values_videos"].reshape(t, h * w, 3, 2, 14 * 14)
    single = [image_processor(images=[f], return_tensors="pt")["pixel_values"].reshape(h * w, 3, 2, 196)[:, :, 0]
              for f in frames]
    assert torch.equal(x[0, :, :, 0], single[0]) and torch.equal(x[0, :, :, 1], single[1])
    assert torch.equal(x[1, :, :, 0], single[2]) and torch.equal(x[1, :, :, 1], single[2])  # padded with the last


def test_sample_indices():
    assert sample_indices(9, 4.0, 2.0, 32) == [0, 1, 3, 5, 7]
    assert sample_indices(300, 30.0, 2.0, 8) == [0, 37, 75, 112, 150, 187, 225, 262]  # capped, spread out
    assert sample_indices(5, None, 2.0, 32) == [0, 1, 2, 3, 4]  # unknown rate: every frame
    assert sample_indices(1, 30.0, 2.0, 32) == [0]
    with pytest.raises(VideoError):
        sample_indices(0, 30.0, 2.0, 32)


def test_video_parts():
    frames = make_frames(20, 10, 2)
    assert video_part_from_value(frames) == VideoPart(frames=tuple(frames))
    with pytest.raises(ValueError, match="no frames"):
        video_part_from_value([])
    with pytest.raises(ValueError, match="not a file path"):
        video_part_from_value(["/etc/passwd"], allow_paths=False)
    mixed = VideoPart(frames=(make_image(20, 10), make_image(21, 10)))
    with pytest.raises(VideoError, match="frame 1 is 21x10 but frame 0 is 20x10"):
        describe_video(mixed)


def test_video_file_without_pyav_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av -> ImportError
    with pytest.raises(VideoError, match=r"pip install 'mserve\[video\]'"):
        describe_video(VideoPart(data=b"\x00\x00\x00\x18ftypmp42"))
