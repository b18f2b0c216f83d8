"""Videos in requests: the two forms a content part may take, their cache key, and video files (PyAV).

A video part is ``{"type": "video", "video": [frame, frame, ...]}`` (each frame image bytes or a data URL,
as an image part carries) or ``{"type": "video", "video": <bytes of a video file>}``. A file is sampled
at admission without decoding a pixel: its packets are counted (demux only) and `sample_indices` (for
Qwen3-VL its processor's own rule, common/families/qwen3_vl.py) picks the frames the model will see, so
the exact token count is known there; the encode worker decodes the file and keeps exactly those frames. Files need PyAV (``pip install 'mserve[video]'``); frame lists do not.
No torch here: the coordinator uses this at admission.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mserve.common.checkpoint_files import (IMAGE_PROCESSOR_FILE, PROCESSOR_FILE, CheckpointError, pixel_bounds,
                                            positive_int, read_json)
from mserve.common.model import ModelFamily, VideoInfo
from mserve.common.images import ImageError, image_hash, image_size_from_header
from mserve.common.policy import DEFAULT_LIMITS

VIDEO_EXTRA = "video"  # the optional dependency group that installs PyAV
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
# Qwen2VLVideoProcessor's own class defaults (not the image processor's: 128·28² .. 768·28² pixels per frame).
QWEN_VIDEO_DEFAULTS = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "max_video_tokens": 128000,
                       "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}


def read_video_settings(model_dir: str | os.PathLike, timestamped_defaults: dict[str, Any] | None = None
                        ) -> dict[str, Any] | None:
    """Qwen2-VL's video processor settings, or None when the checkpoint has none. Found where
    BaseVideoProcessor.get_video_processor_dict finds them (the "video_processor" entry of
    processor_config.json, else video_preprocessor_config.json, else preprocessor_config.json: the hub's
    Qwen2-VL checkpoints) and resolved as Qwen2VLVideoProcessor.__init__ does (class defaults for missing
    keys; min_pixels / max_pixels override size). `timestamped_defaults`: Qwen3VLVideoProcessor's class
    defaults instead (it reads no min_pixels / max_pixels, and samples frames by its own settings)."""
    d = Path(model_dir)
    processor = read_json(d / PROCESSOR_FILE)
    found = None
    if processor is not None and "video_processor" in processor:
        where = f'{d / PROCESSOR_FILE} ("video_processor" entry)'
        if not isinstance(processor["video_processor"], dict):
            raise CheckpointError(f"{where} is {type(processor['video_processor']).__name__}, not an object")
        found = dict(processor["video_processor"]), where
    for name in (VIDEO_PROCESSOR_FILE, IMAGE_PROCESSOR_FILE):
        data = read_json(d / name) if found is None else None
        if data is not None:
            found = data, str(d / name)
            break
    if found is None:
        return None
    proc, where = found
    defaults = timestamped_defaults or QWEN_VIDEO_DEFAULTS
    for key in ("patch_size", "merge_size", "temporal_patch_size", "max_video_tokens"):
        proc[key] = positive_int(proc.get(key, defaults[key]), key, where)
    if timestamped_defaults is not None:
        for key in ("min_pixels", "max_pixels"):
            proc.pop(key, None)
        for key in ("min_frames", "max_frames"):
            proc[key] = positive_int(proc.get(key, defaults[key]), key, where)
        proc["do_sample_frames"] = bool(proc.get("do_sample_frames", defaults["do_sample_frames"]))
    pixel_bounds(proc, defaults["size"], where)
    proc["cap_pixels_per_frame"] = bool(proc.get("cap_pixels_per_frame"))
    return proc


class VideoError(ImageError):
    """A video the user sent cannot be used (undecodable, no video stream, over a limit)."""


@dataclass(frozen=True)
class VideoPart:
    """One video of a request: `frames` (image bytes each), or `data` (a video file) of which the frames at
    `indices` (decode order = presentation order) are used; `indices` is set at admission. `fps` is the
    rate of the frames the model sees (the part's own "fps" for frames; a file's rate times the share
    of frames kept), None when unknown: Qwen2.5-VL's M-RoPE spaces a video's temporal positions by it."""

    frames: tuple[bytes, ...] | None = None
    data: bytes | None = None
    indices: tuple[int, ...] | None = None
    fps: float | None = None

    @property
    def is_file(self) -> bool:
        return self.frames is None

    @property
    def num_frames(self) -> int:
        return len(self.frames) if self.frames is not None else len(self.indices or ())


@dataclass(frozen=True)
class VideoProbe:
    """What admission learns from a video file's container, without decoding pixels."""

    total_frames: int
    fps: float | None
    width: int
    height: int


def payload_bytes(value: Any, what: str, allow_paths: bool) -> bytes:
    """Bytes of an image, frame or video value: raw bytes, a data URL, or (allow_paths) a local file.

    A server passes allow_paths=False: a client must never make it read its own local files.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            try:
                return base64.b64decode(value.split(",", 1)[1], validate=False)
            except Exception as exc:
                raise ValueError(f"{what} data URL is not valid base64: {exc}") from exc
        if value.startswith(("http://", "https://")):
            raise ValueError(f"{what} URLs are not fetched: send the bytes, a data URL or a local path")
        if not allow_paths:
            raise ValueError(f"{what} must be bytes or a data URL, not a file path")
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"{what} path {value!r} does not exist")
        return path.read_bytes()
    raise ValueError(f"{what} is not usable (got {type(value).__name__})")


def video_part_from_value(value: Any, allow_paths: bool = True, fps: Any = None) -> VideoPart:
    """The "video" value of a content part: a list of frames, or one video file (bytes, data URL, path).
    `fps` (the part's "fps"): the rate the frames of a list were taken at; a file's comes from its container."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("video part has no frames")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e4):
            raise ValueError(f"video part fps must be a number of frames per second over 0, got {fps!r}")
        return VideoPart(frames=tuple(payload_bytes(f, f"video frame {i}", allow_paths) for i, f in enumerate(value)),
                         fps=None if fps is None else float(fps))
    if fps is not None:
        raise ValueError("video part fps is for a list of frames: a video file's rate is read from the file")
    return VideoPart(data=payload_bytes(value, "video", allow_paths))


# transformers' VideoMetadata.sampled_fps when a video's rate is unknown (frames given with no fps).
UNKNOWN_VIDEO_FPS = 24.0


def seconds_per_grid(temporal_patch_size: int, fps: float | None) -> float:
    """Seconds one temporal patch of a video spans: Qwen2.5-VL's second_per_grid_ts, as its processor
    computes it (temporal_patch_size / the sampled frames' rate)."""
    return temporal_patch_size / (fps or UNKNOWN_VIDEO_FPS)


def video_hash(video: VideoPart) -> str:
    """The cache key of a video's embeddings: its frames' hashes in order (a file: its hash and the frames
    sampled from it), so the same frames sampled the same way hit, and nothing else does."""
    h = hashlib.blake2b(b"mserve-video\0", digest_size=16)
    if video.frames is not None:
        for f in video.frames:
            h.update(bytes.fromhex(image_hash(f)))
        if video.fps is not None:  # the same frames at another rate take other M-RoPE positions
            h.update(f"fps={video.fps!r}".encode())
    else:
        return video_file_key(image_hash(video.data or b""), video.indices or ())
    return h.hexdigest()


def video_file_key(content_hash: str, indices: Sequence[int]) -> str:
    """`video_hash` of a file from its bytes' blake2b-128, as a media store's ref carries it: an inline and
    a stored copy of one file, sampled alike, share their cache entries."""
    h = hashlib.blake2b(b"mserve-video\0", digest_size=16)
    h.update(b"file\0" + bytes.fromhex(content_hash))
    h.update(",".join(str(i) for i in indices).encode())
    return h.hexdigest()


def visual_hash(item: Any) -> str:
    """An image's (bytes), a video's or an audio clip's (common/audio.py) cache key."""
    from mserve.common.audio import AudioPart, audio_hash

    if isinstance(item, AudioPart):
        return audio_hash(item)
    return video_hash(item) if isinstance(item, VideoPart) else image_hash(item)


def sample_indices(total_frames: int, fps: float | None, target_fps: float, max_frames: int) -> list[int]:
    """Frames to keep from a file of `total_frames` at `fps`: `target_fps` per second of video (every frame
    when its rate is unknown), at least one, at most `max_frames`, spread uniformly (first frame kept)."""
    if total_frames < 1:
        raise VideoError("video file has no frames")
    n = total_frames if not fps or fps <= 0 else math.ceil(total_frames / fps * target_fps - 1e-9)
    n = max(1, min(n, total_frames, max_frames))
    return [i * total_frames // n for i in range(n)]


def _av():
    try:
        import av
    except ImportError:
        raise VideoError(f"video files need PyAV, which is not installed: pip install 'mserve[{VIDEO_EXTRA}]' "
                         "(or send the video as a list of frames)") from None
    return av


def probe_video(data: bytes) -> VideoProbe:
    """Frame count (packets of the first video stream, counted by demuxing only), rate and frame size."""
    av = _av()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoError("video file has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate
            total = sum(1 for packet in container.demux(stream) if packet.size)
    except VideoError:
        raise
    except Exception as exc:  # PyAV raises its own error family for bad input
        raise VideoError(f"cannot read video file: {exc.__class__.__name__}: {exc}") from exc
    if not width or not height:
        raise VideoError("video file does not give its frame size")
    return VideoProbe(total, float(rate) if rate else None, int(width), int(height))


def frame_seconds(indices: Sequence[int], fps: float | None) -> tuple[float, ...]:
    """Each frame's time: its index / the video's rate (24 when unknown, as transformers assumes)."""
    return tuple(i / (fps or UNKNOWN_VIDEO_FPS) for i in indices)


def describe_video(video: VideoPart, target_fps: float = DEFAULT_LIMITS.video_fps,
                   max_frames: int = DEFAULT_LIMITS.max_video_frames,
                   family: ModelFamily | None = None) -> tuple[VideoPart, VideoInfo]:
    """(the part with its frame choice fixed, what its token count depends on). Frames: every one must
    be the same size, and all are seen (already sampled); a file: probed and sampled (by the family's
    own rule for a Qwen3-VL `family`, else `sample_indices`)."""
    if video.frames is not None:
        sizes = [image_size_from_header(f) for f in video.frames]
        for i, size in enumerate(sizes):
            if size != sizes[0]:
                raise VideoError(f"video frame {i} is {size[0]}x{size[1]} but frame 0 is {sizes[0][0]}x{sizes[0][1]}: "
                                 "all frames of a video must have the same size")
        return video, VideoInfo(len(sizes), *sizes[0], frame_seconds(range(len(sizes)), video.fps))
    indices, fps, info = sample_video(probe_video(video.data or b""), target_fps, max_frames, family)
    return VideoPart(data=video.data, indices=indices, fps=fps), info


def sample_video(probe: VideoProbe, target_fps: float, max_frames: int,
                 family: ModelFamily | None = None) -> tuple[tuple[int, ...], float | None, VideoInfo]:
    """A video file's frames to use (its `indices` and their `fps`) and its VideoInfo, from its probe alone
    (read here, or a media store ref's facts: common/media_facts.py)."""
    if probe.total_frames < 1:
        raise VideoError("video file has no frames")
    if family is not None and family.timestamped_video and family.video_config is not None:
        from mserve.common.families import qwen3_vl

        indices = tuple(qwen3_vl.sample_indices(family.video_config, probe.total_frames, probe.fps, target_fps,
                                                max_frames))
    else:
        indices = tuple(sample_indices(probe.total_frames, probe.fps, target_fps, max_frames))
    # transformers' VideoMetadata.sampled_fps: the file's rate times the share of its frames kept.
    fps = len(indices) / probe.total_frames * probe.fps if probe.fps else None
    return indices, fps, VideoInfo(len(indices), probe.width, probe.height, frame_seconds(indices, probe.fps))


def decode_video_file(data: bytes, indices: Sequence[int], max_pixels: int | None = None) -> list[Any]:
    """The frames at `indices` (presentation order) of a video file, as RGB PIL images."""
    av = _av()
    wanted = sorted(set(indices))
    if not wanted:
        raise VideoError("no frames selected from the video file")
    kept: dict[int, Any] = {}
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoError("video file has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    if max_pixels is not None and frame.width * frame.height > max_pixels:
                        raise VideoError(f"video frames are {frame.width}x{frame.height} = {frame.width * frame.height} "
                                         f"pixels, over the limit max_image_pixels={max_pixels}")
                    kept[i] = frame.to_image().convert("RGB")
                if i >= wanted[-1]:
                    break
    except VideoError:
        raise
    except Exception as exc:
        raise VideoError(f"cannot decode video file: {exc.__class__.__name__}: {exc}") from exc
    missing = [i for i in wanted if i not in kept]
    if missing:
        raise VideoError(f"video file decoded to fewer frames than its packets: frame {missing[0]} is missing")
    return [kept[i] for i in indices]
