"""Qwen3-VL's video rules: frame sampling, the patch grid, and the timestamped text a video becomes.

Qwen3VLProcessor expands a video placeholder as text before tokenizing: per temporal patch (a group
of temporal_patch_size frames) "<t seconds>" then <|vision_start|>, that group's video tokens and
<|vision_end|>, where t is the mean time of the group's first and last frame (frame index / the
video's rate, 24 when unknown). Its video processor samples a file's frames uniformly
(np.linspace(...).round()) and sizes a whole clip at once (the pixel budget covers every frame).
Here are those rules, written after transformers' Qwen3VLProcessor / Qwen3VLVideoProcessor, so
admission counts a video's tokens from its headers. No torch here: the coordinator uses this.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from mserve.common.families import FamilyRules

# Qwen3VLVideoProcessor's class defaults (not Qwen2-VL's): 32 px merged patches, a budget over the clip.
VIDEO_DEFAULTS = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "max_video_tokens": 768,
                  "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                  "fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True}
UNKNOWN_FPS = 24.0  # what Qwen3VLProcessor assumes for frames given without a rate


def sample_indices(cfg: dict[str, Any], total_frames: int, fps: float | None, target_fps: float,
                   max_frames: int) -> list[int]:
    """Frames a file of `total_frames` at `fps` is sampled to: Qwen3VLVideoProcessor.sample_frames with
    fps=target_fps (every frame when the checkpoint does not sample), then at most `max_frames` (the
    server's limit: the same linspace as sample_frames with num_frames=max_frames)."""
    if not cfg.get("do_sample_frames", True):
        n = total_frames
    else:
        n = int(total_frames / (fps or UNKNOWN_FPS) * target_fps)
        n = min(max(n, cfg["min_frames"]), cfg["max_frames"], total_frames)
    n = min(n, max_frames)
    if n <= 1:
        return [0] * n
    # np.linspace(0, total - 1, n).round(): start + i * step, rounded half to even
    step = (total_frames - 1) / (n - 1)
    return [int(round(i * step)) if i < n - 1 else total_frames - 1 for i in range(n)]


def _smart_resize(num_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                  max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: the bounds cover every frame of the clip (t x h x w)."""
    from mserve.common.images import ImageError

    if num_frames < temporal:
        raise ImageError(f"Qwen3-VL needs at least temporal_patch_size={temporal} frames per video, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"video aspect ratio {width}x{height} is over 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(cfg: dict[str, Any], num_frames: int, width: int, height: int) -> tuple[int, int]:
    """(height, width) every frame is resized to (Qwen3VLVideoProcessor.resize, its optional per-frame cap)."""
    factor = cfg["patch_size"] * cfg["merge_size"]
    max_pixels = cfg["max_pixels"]
    if cfg.get("cap_pixels_per_frame"):
        per_frame = max(min(cfg["max_video_tokens"] * factor * factor, cfg["max_pixels"] // num_frames),
                        int(cfg["min_pixels"] * 1.05))
        max_pixels = per_frame * num_frames
    return _smart_resize(num_frames, height, width, cfg["temporal_patch_size"], factor, cfg["min_pixels"], max_pixels)


def video_grid(cfg: dict[str, Any], num_frames: int, width: int, height: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a video, as get_num_of_video_patches computes it."""
    h, w = resized_size(cfg, num_frames, width, height)
    tps = cfg["temporal_patch_size"]
    return -(-num_frames // tps), h // cfg["patch_size"], w // cfg["patch_size"]


def group_seconds(frame_seconds: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps: the last frame repeats to fill the last group; each group's
    time is the mean of its first and last frame's."""
    times = list(frame_seconds)
    if pad := -len(times) % temporal_patch_size:
        times.extend([times[-1]] * pad)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_text(processor: Any, frame_seconds: Sequence[float], temporal_patch_size: int, tokens_per_group: int) -> str:
    """The text one video placeholder becomes (Qwen3VLProcessor.replace_video_token)."""
    group = processor.vision_start_token + processor.video_token * tokens_per_group + processor.vision_end_token
    return "".join(f"<{t:.1f} seconds>" + group for t in group_seconds(frame_seconds, temporal_patch_size))


def video_wrapper(processor: Any) -> str:
    """What the chat template renders for a video, which the processor collapses into the expansion."""
    return processor.vision_start_token + processor.video_token + processor.vision_end_token


RULES = FamilyRules(timestamped_video_defaults=VIDEO_DEFAULTS)
