"""Qwen3-VL video at admission, checked against transformers' own Qwen3-VL processor and video processor.

Qwen3VLVideoProcessor needs torchvision (not installed here) for its pixels; its frame sampling, its
smart_resize and its patch count are torch-free and are called directly (module imported with
torchvision stubbed out). The prompt oracle is Qwen3VLProcessor.__call__ itself, with transformers' own
Qwen3VLVideoProcessor (sampling, metadata, clip sizing, timestamps, expansion, tokenizer); only the
torchvision pixel resize is stood in for. mserve's prompt ids (and so its admission count) must equal its.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mserve.common.families import qwen3_vl
from mserve.common.model import VideoInfo
from mserve.common.prompt import PromptBuilder
from mserve.common.video import VideoPart, describe_video
from tests.helpers import PROMPTS, import_without_torchvision, make_frames, make_image, make_video_file


@pytest.fixture(scope="module")
def builder(tiny_model_dirs) -> PromptBuilder:
    return PromptBuilder(str(tiny_model_dirs["qwen3_vl"]))


@pytest.fixture(scope="module")
def hf_module():
    return import_without_torchvision("transformers.models.qwen3_vl.video_processing_qwen3_vl")


def hf_settings(cfg: dict, **overrides) -> SimpleNamespace:
    """The video processor's settings as `self` for its torch-free methods."""
    settings = {"size": {"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]},
                "patch_size": cfg["patch_size"], "merge_size": cfg["merge_size"],
                "temporal_patch_size": cfg["temporal_patch_size"], "fps": cfg["fps"], "min_frames": cfg["min_frames"],
                "max_frames": cfg["max_frames"], "num_frames": None, "cap_pixels_per_frame": False,
                "max_video_tokens": cfg["max_video_tokens"], **overrides}
    return SimpleNamespace(**settings, _merge_and_standardize_kwargs=lambda **kw: {**settings, **kw})


@pytest.mark.parametrize("total,fps", [(9, 4.0), (100, 30.0), (7, None), (3, 2.0), (61, 29.97), (2000, 25.0)])
def test_file_sampling_is_the_video_processors(builder, hf_module, total, fps):
    from transformers.video_utils import VideoMetadata

    cfg = builder.family.video_config
    theirs = hf_module.Qwen3VLVideoProcessor.sample_frames(hf_settings(cfg), VideoMetadata(total, fps), fps=2.0)
    assert qwen3_vl.sample_indices(cfg, total, fps, 2.0, 10**6) == theirs.tolist()
    # over the server's frame limit: the processor's own linspace with num_frames=limit
    capped = hf_module.Qwen3VLVideoProcessor.sample_frames(hf_settings(cfg), VideoMetadata(total, fps), num_frames=3)
    assert qwen3_vl.sample_indices(cfg, total, fps, 2.0, 3) == (theirs if len(theirs) <= 3 else capped).tolist()


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("num_frames", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("size", [(120, 90), (20, 300), (1920, 1080), (64, 64)])
def test_token_count_is_the_video_processors(builder, hf_module, num_frames, size, cap):
    cfg = {**builder.family.video_config, "cap_pixels_per_frame": cap}
    patches = hf_module.Qwen3VLVideoProcessor.get_num_of_video_patches(
        hf_settings(cfg, cap_pixels_per_frame=cap), num_frames, size[1], size[0], {})
    t, h, w = qwen3_vl.video_grid(cfg, num_frames, *size)
    assert t * h * w == patches


def test_one_frame_is_refused_naming_the_temporal_patch(builder):
    with pytest.raises(ValueError, match="at least temporal_patch_size=2 frames"):
        builder.family.video_token_count(VideoInfo(1, 120, 90, (0.0,)))


@pytest.fixture(scope="module")
def hf_processor(builder, hf_module):
    """The checkpoint's Qwen3VLProcessor with transformers' own Qwen3VLVideoProcessor (its settings from the
    checkpoint): frame sampling, metadata, clip sizing, patchify and the prompt expansion are all theirs;
    only the pixel resize (torchvision's) is stood in for, as pixels do not reach the ids."""
    import copy
    import json

    from transformers.video_processing_utils import BaseVideoProcessor

    class NoTorchvisionResize(BaseVideoProcessor):
        def resize(self, image, size, resample=None, **kwargs):
            x = image.float()
            out = torch.nn.functional.interpolate(x.reshape(-1, *x.shape[-3:]), size=(size.height, size.width))
            return out.reshape(*x.shape[:-2], size.height, size.width)

    class VideoProcessor(hf_module.Qwen3VLVideoProcessor, NoTorchvisionResize):  # Qwen3-VL's resize, then this
        pass

    settings = json.loads((Path(builder.model_dir) / "video_preprocessor_config.json").read_text())
    proc = copy.copy(builder.family.processor)
    proc.video_processor = VideoProcessor(**{k: v for k, v in settings.items()
                                             if k not in ("video_processor_type", "processor_class")})
    return proc


def processor_ids(proc, builder: PromptBuilder, content: list, images: list, videos: list, metadata: list,
                  **video_kwargs) -> list[int]:
    """Qwen3VLProcessor.__call__'s input_ids for one user turn (`videos`: arrays [frames, h, w, 3])."""
    from mserve.common.prompt import normalize_messages

    norm, _ = normalize_messages([{"role": "user", "content": content}])
    out = proc(text=[builder.render(norm)], images=images or None, videos=videos, video_metadata=metadata,
               do_convert_rgb=False, do_rescale=False, do_normalize=False, cap_pixels_per_frame=False,
               **video_kwargs)
    return list(out["input_ids"][0])


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def frames_array(frames: list[bytes]) -> np.ndarray:
    return np.stack([np.asarray(pil(f)) for f in frames])


@pytest.mark.parametrize("n,size,fps", [(4, (120, 90), 2.0), (5, (64, 200), None), (8, (320, 240), 0.5),
                                        (2, (33, 33), 29.97), (11, (90, 120), 7.0)])
def test_frames_prompt_equals_the_processors(builder, hf_processor, n, size, fps):
    """A list of frames is the video as seen (the processor's do_sample_frames=False, its fps in the metadata)."""
    from transformers.video_utils import VideoMetadata

    frames = make_frames(*size, n, seed=n)
    image = make_image(100, 70, seed=1)
    content = [{"type": "image", "image": image}, {"type": "video", "video": frames, **({"fps": fps} if fps else {})},
               {"type": "text", "text": PROMPTS[0]}]
    pp = builder.prepare([{"role": "user", "content": content}])
    meta = VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
    assert pp.prompt_ids == processor_ids(hf_processor, builder, content, [pil(image)], [frames_array(frames)], [meta],
                                          do_sample_frames=False)
    info = pp.image_sizes[1]
    assert pp.prompt_ids.count(builder.family.video_token_id) == builder.family.video_token_count(info)


@pytest.mark.parametrize("total,fps", [(9, 4), (20, 10), (5, 1), (30, 30)])
def test_file_prompt_equals_the_processors(builder, hf_processor, total, fps):
    """A file: sampled as the video processor samples it (fps=2), timestamps from the kept frames' indices."""
    pytest.importorskip("av")
    from transformers.video_utils import VideoMetadata

    frames = make_frames(96, 64, total, seed=total)
    content = [{"type": "video", "video": make_video_file(frames, fps=fps)}, {"type": "text", "text": PROMPTS[1]}]
    pp = builder.prepare([{"role": "user", "content": content}])
    meta = VideoMetadata(total_num_frames=total, fps=float(fps))
    ids = processor_ids(hf_processor, builder, content, [], [frames_array(frames)], [meta], do_sample_frames=True,
                        fps=2.0)
    assert pp.prompt_ids == ids
    theirs = hf_processor.video_processor.sample_frames(meta, fps=2.0)  # what __call__ sampled
    assert list(pp.images[0].indices) == theirs.tolist()


def test_timestamps_follow_the_rate(builder):
    """Not vacuous: the same frames at another rate give other timestamp text (and so other ids)."""
    frames = make_frames(64, 64, 4, seed=3)
    ids = [builder.prepare([{"role": "user", "content": [{"type": "video", "video": frames, "fps": r},
                                                          {"type": "text", "text": "x"}]}]).prompt_ids
           for r in (1.0, 4.0)]
    assert ids[0] != ids[1]
    text = builder.tokenizer.decode(ids[0])
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text


def test_describe_video_keeps_every_listed_frame(builder):
    part = VideoPart(frames=tuple(make_frames(64, 64, 6)), fps=3.0)
    same, info = describe_video(part, family=builder.family)
    assert same is part and info.frame_seconds == tuple(i / 3.0 for i in range(6))
    assert np.isclose(info.frame_seconds[-1], 5 / 3)


@pytest.mark.parametrize("layout", ["processor", "preprocessor"])
def test_video_settings_are_read_where_transformers_reads_them(tmp_path, layout):
    """Both tiny layouts (nested in processor_config.json, or the hub's video_preprocessor_config.json):
    the settings transformers' video processor would load, Qwen3-VL's class defaults for missing keys."""
    import json

    from transformers.video_processing_utils import BaseVideoProcessor

    from mserve.common.model import load_family
    from mserve.common.tiny_model import make_tiny_model

    d = tmp_path / layout
    make_tiny_model(d, arch="qwen3_vl", layout=layout)
    theirs, _ = BaseVideoProcessor.get_video_processor_dict(str(d))
    cfg = load_family(d).video_config
    assert (cfg["min_pixels"], cfg["max_pixels"]) == (theirs["size"]["shortest_edge"], theirs["size"]["longest_edge"])
    assert {k: cfg[k] for k in ("patch_size", "fps", "min_frames", "max_frames", "do_sample_frames")} == \
        {k: theirs[k] for k in ("patch_size", "fps", "min_frames", "max_frames", "do_sample_frames")}
    # keys left out take Qwen3VLVideoProcessor's class defaults, not Qwen2-VL's
    path = d / ("video_preprocessor_config.json" if layout == "preprocessor" else "processor_config.json")
    data = json.loads(path.read_text())
    video = data if layout == "preprocessor" else data["video_processor"]
    for key in ("size", "patch_size", "min_frames"):
        video.pop(key)
    video["num_frames"] = 8
    path.write_text(json.dumps(data))
    family = load_family(d)
    assert (family.video_config["min_pixels"], family.video_config["max_pixels"]) == (128 * 32 * 32, 32 * 32 * 768)
    assert (family.video_config["patch_size"], family.video_config["min_frames"]) == (16, 4)
    assert "samples a fixed num_frames=8" in family.video_unsupported()
