"""Qwen2-VL video preprocessing without torchvision: `pixel_values_videos` and `video_grid_thw`.

transformers' Qwen2VLVideoProcessor needs torchvision, which CPU hosts here do not have. Its math is:
resize every frame with smart_resize (the video processor's pixel bounds, optionally capped per frame),
rescale, normalize, pad the frame count to a multiple of temporal_patch_size by repeating the last frame,
and lay out patches as (t, h/merge, w/merge, merge, merge) x (channel, temporal, patch, patch).

Here each frame goes through the checkpoint's own Qwen2-VL *image* processor (PIL backend), called with
the video processor's settings: that gives the resized, rescaled, normalized frame patchified in the
image layout, which is the video layout with one frame copied over the temporal slots. `temporal_patches`
then puts `temporal_patch_size` consecutive frames in those slots. The resize is PIL's (as for images),
not torchvision's, so pixels can differ in the last bits from transformers' video processor; the grid
and hence the token count are the same.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from mserve.common.model import ModelFamily

from mserve.common.images import ImageError

# Qwen2VLVideoProcessor's class defaults for the per-frame steps (OPENAI_CLIP_MEAN / _STD, BICUBIC).
VIDEO_FRAME_DEFAULTS = {"resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 1 / 255,
                        "do_resize": True, "do_rescale": True, "do_normalize": True}

# Qwen3VLVideoProcessor's (IMAGENET_STANDARD_MEAN / _STD).
QWEN3_VIDEO_FRAME_DEFAULTS = {**VIDEO_FRAME_DEFAULTS, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def frame_kwargs(family: ModelFamily, num_frames: int) -> dict[str, Any]:
    """The image processor call arguments that make it process one frame as the video processor would."""
    cfg = family.video_config
    if cfg is None:
        raise ImageError(family.video_unsupported() or "no video settings")
    defaults = VIDEO_FRAME_DEFAULTS if not family.timestamped_video else QWEN3_VIDEO_FRAME_DEFAULTS
    out = {k: v if cfg.get(k) is None else cfg[k] for k, v in defaults.items()}
    out.update(size={"shortest_edge": cfg["min_pixels"], "longest_edge": family.video_max_pixels(num_frames)},
               patch_size=cfg["patch_size"], merge_size=cfg["merge_size"],
               temporal_patch_size=cfg["temporal_patch_size"])
    return out


def temporal_patches(frame_patches: np.ndarray, num_frames: int, channels: int, temporal_patch_size: int,
                     patch_size: int) -> tuple[np.ndarray, int]:
    """Per-frame patches in the image processor's layout ([frames * N, C * T * p * p], each frame copied over
    the T temporal slots) -> Qwen2VLVideoProcessor.patchify's layout ([t * N, C * T * p * p], T consecutive
    frames per group, the last frame repeated to fill the last group); returns it and t."""
    pp = patch_size * patch_size
    x = frame_patches.reshape(num_frames, -1, channels, temporal_patch_size, pp)[:, :, :, 0, :]
    if pad := -num_frames % temporal_patch_size:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    t = x.shape[0] // temporal_patch_size
    x = x.reshape(t, temporal_patch_size, x.shape[1], channels, pp).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(x).reshape(-1, channels * temporal_patch_size * pp), t


def qwen_video_inputs(image_processor: Any, family: ModelFamily, videos: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    """Videos (each a list of RGB PIL frames of one size) -> {pixel_values_videos, video_grid_thw}."""
    cfg = family.video_config or {}
    pixels, grids = [], []
    for v, frames in enumerate(videos):
        if not frames:
            raise ImageError(f"video {v} has no frames")
        if any(f.size != frames[0].size for f in frames):
            raise ImageError(f"video {v}: all frames of a video must have the same size")
        kwargs = frame_kwargs(family, len(frames))
        if family.timestamped_video:
            # Qwen3-VL sizes the clip as a whole (common/families/qwen3_vl.py): every frame is resized to
            # that size here, and the image processor only rescales, normalizes and patchifies.
            from mserve.common.families import qwen3_vl

            h, w = qwen3_vl.resized_size(cfg, len(frames), *frames[0].size)
            frames = [f.resize((w, h), resample=kwargs["resample"]) for f in frames]
            kwargs["do_resize"] = False
        out = image_processor(images=list(frames), return_tensors="np", **kwargs)
        grid = np.asarray(out["image_grid_thw"])
        patches, t = temporal_patches(np.asarray(out["pixel_values"], dtype=np.float32), len(frames), 3,
                                      cfg["temporal_patch_size"], cfg["patch_size"])
        pixels.append(patches)
        grids.append([t, int(grid[0][1]), int(grid[0][2])])
    return {"pixel_values_videos": torch.from_numpy(np.concatenate(pixels)),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
