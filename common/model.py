"""Loads a local VLM checkpoint's rules: visual token counts, placeholders, positions.

Everything model-specific that the coordinator (no tensors) and the workers (tensors) both need
lives in one `ModelFamily`, built on the checkpoint's own processor (common/processor.py), so
admission and the engine can never disagree on how many placeholder tokens an image becomes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence


from mserve.common.images import ImageError, image_size_from_header
from mserve.common.checkpoint_files import CheckpointError, read_image_processor_config, read_model_config
from mserve.common.families import FamilyRules, audio_settings, rules_for
from mserve.common.served_models import (AUDIO_MODEL_TYPES, KNOWN_GAPS, SERVED_MODEL_TYPES, VIDEO_MODEL_TYPES,
                                         has_audio_tower)
from mserve.common.traits import read_traits

@dataclass(frozen=True)
class VideoInfo:
    """What the token count of one video depends on: the frames the model sees (after sampling, before
    any temporal padding) and their common size."""

    num_frames: int
    width: int
    height: int
    # Each seen frame's time in the video, in seconds (its index / the video's rate, 24 when unknown):
    # Qwen3-VL prints them as text in the prompt. None for a VideoInfo made without them.
    frame_seconds: tuple[float, ...] | None = None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after Qwen2-VL's smart_resize: transformers' arithmetic, kept here so the coordinator needs no torch."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {width}x{height} is over 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class ModelFamily:
    """The per-checkpoint rules, built from its config files and processor (no weights).

    `processor` is the checkpoint's own transformers processor (common/processor.py): image token
    counts are its `_get_num_multimodal_tokens`. `processor_config` holds the image processor's saved
    settings and `processor_source` the file they came from. `video_config` holds Qwen2-VL's video
    processor settings (resolved as transformers' Qwen2VLVideoProcessor resolves them, or
    Qwen3VLVideoProcessor for Qwen3-VL; None when the checkpoint has none); a family without a video token takes a video as its frames, each one an image."""

    model_type: str
    image_token_id: int
    text_config: dict[str, Any]
    processor_config: dict[str, Any]
    vision_config: dict[str, Any]
    processor: Any = None
    processor_source: str = ""
    video_token_id: int | None = None
    video_config: dict[str, Any] | None = None
    # What this family does differently from the generic path (common/families/).
    rules: FamilyRules = field(default_factory=FamilyRules)
    # Opt-in visual-token pruning (common/pruning.py): the share of each image's visual tokens
    # kept; None = off. Set only through pruning.apply, which refuses families that cannot prune.
    visual_keep_ratio: float | None = None
    # A family with tests here (SERVED_MODEL_TYPES); False: served only once a probe proved it (workers/probe.py).
    tested: bool = True
    # An audio family's (AUDIO_MODEL_TYPES) audio token and its count settings (common/families' audio_settings:
    # qwen2_audio.py's AudioFeatures, voxtral.py's VoxtralAudio, gemma4.py's AudioFeatures); None for a checkpoint
    # that takes no audio. A family with no image token (Qwen2-Audio) has image_token_id NO_TOKEN.
    audio_token_id: int | None = None
    audio_features: Any = None

    @property
    def takes_images(self) -> bool:
        return self.image_token_id != NO_TOKEN and self.rules.no_images is None

    def image_unsupported(self) -> str | None:
        """Why this checkpoint cannot take an image, or None."""
        if self.rules.no_images is not None:
            return self.rules.no_images
        return None if self.takes_images else f"model_type {self.model_type} has no image input"

    @property
    def modalities(self) -> list[str]:
        """What a request to this checkpoint may hold (STATUS and the gateway's /v1/models say it)."""
        return ["text"] + (["image"] if self.takes_images else []) + \
            (["video"] if self.takes_images and self.video_unsupported() is None else []) + \
            (["audio"] if self.audio_unsupported() is None else [])

    def audio_unsupported(self) -> str | None:
        """Why this checkpoint cannot take an audio clip, or None."""
        if self.audio_features is None and self.model_type in AUDIO_MODEL_TYPES:
            return f"this {self.model_type} checkpoint has no audio tower (its config.json has no audio_config)"
        if self.audio_features is None:
            return (f"model_type {self.model_type} has no audio tower mserve serves (audio is served for "
                    f"{', '.join(AUDIO_MODEL_TYPES)})")
        return None

    def audio_token_count(self, info: Any) -> int:
        """Exact audio placeholder tokens of one clip (common/audio.py: AudioInfo)."""
        return self.audio_features.tokens(info.resampled_samples(self.audio_features.sampling_rate))

    @property
    def uses_mrope(self) -> bool:
        """3-D rotary positions (Qwen2/2.5-VL): the text config's rope carries an mrope_section."""
        rope = self.text_config.get("rope_parameters") or self.text_config.get("rope_scaling") or {}
        return "mrope_section" in rope

    @property
    def bidirectional_images(self) -> bool:
        """One image's placeholder tokens attend to each other both ways, on top of causal attention."""
        when = self.rules.bidirectional_images_if
        return self.rules.bidirectional_images and (when is None or when(self.text_config))

    @property
    def video_as_frames(self) -> bool:
        """A video becomes one image per frame (no video token); otherwise it has its own placeholder and tower path."""
        return self.video_token_id is None

    @property
    def timestamped_video(self) -> bool:
        """A video is Qwen3-VL's kind: one placeholder run per frame group, each after its "<t seconds>"."""
        return self.rules.timestamped_video_defaults is not None and self.video_token_id is not None

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return tuple(t for t in (self.image_token_id, self.video_token_id, self.audio_token_id)
                     if t is not None and t != NO_TOKEN)

    def video_unsupported(self) -> str | None:
        """Why this checkpoint cannot take a video, or None."""
        if self.rules.no_video is not None:
            return self.rules.no_video
        if not self.tested:  # the load-time probe proves images only (workers/probe.py)
            return (f"video input is not supported for model_type {self.model_type}: a family verified at load "
                    "is proven on images only")
        if self.video_as_frames:
            return None
        if self.model_type not in VIDEO_MODEL_TYPES:
            return (f"video input is not supported for model_type {self.model_type} "
                    f"(video is served for {', '.join(VIDEO_MODEL_TYPES)} and the families that take frames as images)")
        if self.video_config is None:
            return "this checkpoint has no video processor settings"
        if self.timestamped_video and self.video_config.get("num_frames") is not None:
            return (f"this checkpoint's video processor samples a fixed num_frames={self.video_config['num_frames']}, "
                    "which mserve does not (it samples a file by video_fps)")
        return None

    def video_grid(self, video: VideoInfo) -> tuple[int, int, int]:
        """Qwen2-VL (t, h, w) patch grid of a video: frames resized with the video processor's pixel bounds
        (and its optional per-frame cap), padded to a multiple of temporal_patch_size by repeating the last."""
        cfg = self.video_config
        if cfg is None:
            raise ImageError(self.video_unsupported() or "no video settings")
        if self.timestamped_video:
            from mserve.common.families import qwen3_vl

            return qwen3_vl.video_grid(cfg, video.num_frames, video.width, video.height)
        patch, merge, tps = cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]
        factor = patch * merge
        h, w = smart_resize(video.height, video.width, factor, cfg["min_pixels"], self.video_max_pixels(video.num_frames))
        return -(-video.num_frames // tps), h // patch, w // patch

    @property
    def merge_size(self) -> int:
        """Patches merged per side into one visual token (Qwen2-VL); 1 for a family without merging."""
        return int(self.processor_config.get("merge_size") or 1)

    def image_grid(self, image_size: tuple[int, int]) -> tuple[int, int, int] | None:
        """Qwen2-VL (t, h, w) patch grid of one image of (width, height), as its image processor resizes it;
        None for a family without grids (or settings this rule does not know)."""
        cfg = self.processor_config
        size = cfg.get("size") or {}
        low, high = cfg.get("min_pixels") or size.get("shortest_edge"), cfg.get("max_pixels") or size.get("longest_edge")
        if self.uses_mrope and self.rules.image_grid is not None:
            return self.rules.image_grid(self.processor, image_size)
        if not self.uses_mrope or "patch_size" not in cfg or not low or not high:
            return None
        patch = int(cfg["patch_size"])
        width, height = image_size
        h, w = smart_resize(height, width, patch * self.merge_size, int(low), int(high))
        return 1, h // patch, w // patch

    def video_max_pixels(self, num_frames: int) -> int:
        """Qwen2VLVideoProcessor.resize's pixel bound for one frame of a video of `num_frames` frames."""
        cfg = self.video_config or {}
        max_pixels = cfg["max_pixels"]
        if cfg.get("cap_pixels_per_frame"):
            factor = cfg["patch_size"] * cfg["merge_size"]
            total = int(cfg["max_video_tokens"] * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * cfg["temporal_patch_size"] // num_frames),
                             int(cfg["min_pixels"] * 1.05))
        return max_pixels

    def video_token_count(self, video: VideoInfo, keep_ratio: float | None = None) -> int:
        """Exact number of placeholder tokens one video becomes (as frames: one image's count per frame)."""
        if self.video_as_frames:
            return video.num_frames * self.visual_token_count((video.width, video.height), keep_ratio)
        t, h, w = self.video_grid(video)
        return t * h * w // (self.video_config["merge_size"] ** 2)

    def visual_token_count(self, image_size: tuple[int, int] | VideoInfo, keep_ratio: float | None = None) -> int:
        """Exact number of placeholder tokens one image of (width, height), or one video, becomes.
        `keep_ratio`: one request's own pruning ratio (SLO-adaptive pruning), else the family's."""
        if isinstance(image_size, VideoInfo):
            return self.video_token_count(image_size, keep_ratio)
        if not isinstance(image_size, tuple):  # an audio clip's AudioInfo
            return self.audio_token_count(image_size)
        from mserve.common.processor import image_token_count

        width, height = image_size
        if self.uses_mrope:  # Qwen's smart_resize refuses extreme shapes with a bare ValueError
            if max(height, width) / max(min(height, width), 1) > 200:
                raise ImageError(f"image aspect ratio {width}x{height} is over 200:1")
        count = image_token_count(self.processor, width, height)
        ratio = self.visual_keep_ratio if keep_ratio is None else keep_ratio
        if ratio is not None:
            from mserve.common.pruning import kept_tokens

            return kept_tokens(count, ratio)
        return count

    @property
    def vision_feature_select_strategy(self) -> str:
        return getattr(self.processor, "vision_feature_select_strategy", None) or "default"

    def placeholder_sizes(self, items: Sequence[tuple[int, int] | VideoInfo]) -> list[tuple[int, int] | VideoInfo]:
        """One entry per placeholder the chat template renders: a video stays one (Qwen2-VL) or becomes
        one image size per frame (LLaVA, see `PromptBuilder`)."""
        out: list[tuple[int, int] | VideoInfo] = []
        for item in items:
            if isinstance(item, VideoInfo) and self.video_as_frames:
                out.extend([(item.width, item.height)] * item.num_frames)
            else:
                out.append(item)
        return out

    def expand_placeholders(self, token_ids: Sequence[int], image_sizes: Sequence[tuple[int, int] | VideoInfo],
                            keep_ratio: float | None = None) -> list[int]:
        """Replace each image (video) token by as many copies as that image (video) has visual tokens.

        `image_sizes` has one entry per placeholder, in prompt order: (width, height) for an image
        token, a VideoInfo for a video token."""
        out: list[int] = []
        images = iter(image_sizes)
        for tok in token_ids:
            if tok in self.placeholder_ids:
                size = next(images, None)
                if tok == self.audio_token_id:
                    if size is None or isinstance(size, (tuple, VideoInfo)):
                        raise ValueError("the chat template placed an audio placeholder where the request has "
                                         + ("no more items" if size is None else "another kind"))
                    out.extend(self.audio_placeholder(self.audio_token_count(size)))
                    continue
                kind = "video" if tok == self.video_token_id else "image"
                if size is None:
                    raise ValueError(f"prompt has more {kind} placeholders than {kind}s")
                if isinstance(size, VideoInfo) != (kind == "video") or not isinstance(size, (tuple, VideoInfo)):
                    raise ValueError(f"the chat template placed the images and videos in another order than "
                                     f"the request (a {kind} placeholder where the request has another kind)")
                out.extend(self.image_placeholder(size, keep_ratio) if kind == "image"
                           else [tok] * self.visual_token_count(size, keep_ratio))
            else:
                out.append(tok)
        if next(images, None) is not None:
            raise ValueError("prompt has fewer image placeholders than images")
        return out

    def image_placeholder(self, size: tuple[int, int], keep_ratio: float | None = None) -> list[int]:
        """The token ids one image placeholder becomes: its visual tokens, as one run of the image token
        unless the family lays them out otherwise (rows with separators: common/families/). Pruning is
        LLaVA's (common/pruning.py): a pruned image is always one run."""
        if self.rules.image_placeholder is None or self.visual_keep_ratio is not None or keep_ratio is not None:
            return [self.image_token_id] * self.visual_token_count(size, keep_ratio)
        return self.rules.image_placeholder(self.processor, size)

    def audio_placeholder(self, count: int) -> list[int]:
        """The token ids one audio placeholder of `count` soft tokens becomes (one run, unless the family
        brackets it: common/families/)."""
        if self.rules.audio_placeholder is None:
            return [self.audio_token_id] * count
        return self.rules.audio_placeholder(self.processor, count)

    def image_inputs(self, images: Sequence[Any]) -> Any:
        """The vision tower's inputs for PIL images, prepared as the checkpoint's processor prepares them."""
        if self.rules.image_inputs is not None:
            return self.rules.image_inputs(self.processor, images)
        return self.processor.image_processor(images=list(images), return_tensors="pt")

    def image_spans(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of one placeholder token (image or video), in order. One image may
        cover several consecutive runs (a Pixtral image: one run per row; SmolVLM: one per tile;
        see hashing.item_spans)."""
        spans: list[tuple[int, int]] = []
        ids = self.placeholder_ids
        i, n = 0, len(token_ids)
        while i < n:
            if token_ids[i] in ids:
                j, tok = i, token_ids[i]
                while j < n and token_ids[j] == tok:
                    j += 1
                spans.append((i, j - i))
                i = j
            else:
                i += 1
        return spans


NO_TOKEN = -1  # the image_token_id of a family that has no image token (an audio-only one)


def _checked_processor(model_dir: str | os.PathLike, model_type: str, tokenizer: Any, where: str) -> Any:
    """The family's processor, refused at load (naming the settings file) when it cannot count one
    image's tokens: transformers would fail on the first image, or place no token for it."""
    from mserve.common.processor import UnsupportedModelError, build_processor, image_token_count

    try:
        processor = build_processor(model_dir, model_type, tokenizer)
        if getattr(processor, "image_processor", None) is None and (
                model_type in AUDIO_MODEL_TYPES or rules_for(model_type).no_images is not None):
            return processor  # no image to count: an audio-only family (its count: families' audio_settings), or
            # one whose images are refused (FamilyRules.no_images)
        probe = image_token_count(processor, 224, 224)
    except (UnsupportedModelError, OSError):
        raise
    except Exception as exc:  # transformers raises many types on bad settings
        raise CheckpointError(f"{where}: the {model_type} processor built from these settings cannot count an "
                              f"image's tokens ({type(exc).__name__}: {exc})") from exc
    if probe < 1:
        raise CheckpointError(f"{where}: the {model_type} processor built from these settings gives a 224x224 "
                              f"image {probe} tokens")
    return processor


def load_family(model_dir: str | os.PathLike, tokenizer: Any = None) -> ModelFamily:
    """The rules of the checkpoint in `model_dir`; a family the engine cannot serve exactly is refused
    here with one line naming what is missing (UnsupportedModelError)."""
    from mserve.common.processor import UnsupportedModelError, processor_class

    cfg = read_model_config(model_dir)
    model_type = cfg.get("model_type")
    if model_type in KNOWN_GAPS:
        raise UnsupportedModelError(f"model_type {model_type!r} needs {KNOWN_GAPS[model_type]}")
    processor_class(model_type)  # names a processor without the token-count hook
    # A family without tests here serves if its traits are all ones the engine honours; a worker then
    # proves its tokens against HF before it says READY (workers/probe.py).
    tested = model_type in SERVED_MODEL_TYPES
    rules = rules_for(model_type)
    if gaps := read_traits(cfg).unsupported(rules.honoured_traits if tested else frozenset()):
        raise UnsupportedModelError(f"model_type {model_type!r}: {'; '.join(gaps)}")
    if rules.config_gap is not None and (gap := rules.config_gap(cfg)) is not None:
        raise UnsupportedModelError(f"model_type {model_type!r}: this checkpoint needs {gap}")
    image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    audio_token_id, audio = cfg.get("audio_token_index", cfg.get("audio_token_id")), has_audio_tower(model_type, cfg)
    if image_token_id is None and not audio:
        raise UnsupportedModelError(f"{model_dir}/config.json has no image_token_id")
    takes_images = image_token_id is not None and rules.no_images is None
    proc, where = read_image_processor_config(model_dir) if takes_images else ({}, "")
    processor = _checked_processor(model_dir, model_type, tokenizer, where)
    audio_features = audio_settings(model_type, model_dir, cfg, processor) if audio else None
    if rules.processor_gap is not None and (why := rules.processor_gap(cfg, proc, processor)) is not None:
        raise UnsupportedModelError(f"model_type {model_type!r}: {model_dir} uses {why}")
    video_token_id, video_config = cfg.get("video_token_id"), None
    if video_token_id is not None and rules.no_video is None:  # a family that takes no video reads no settings
        from mserve.common.video import read_video_settings  # video.py builds on this module

        video_config = read_video_settings(model_dir, rules.timestamped_video_defaults)
    return ModelFamily(
        model_type=model_type,
        image_token_id=NO_TOKEN if image_token_id is None else int(image_token_id),
        text_config=cfg.get("text_config", {}),
        processor_config=proc,
        vision_config=cfg.get("vision_config", {}),
        processor=processor,
        processor_source=where,
        video_token_id=None if video_token_id is None else int(video_token_id),
        video_config=video_config,
        rules=rules,
        tested=tested,
        audio_token_id=int(audio_token_id) if audio_features is not None else None,
        audio_features=audio_features,
    )
