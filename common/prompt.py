"""Builds prompt token ids from OpenAI-style chat messages with the checkpoint's own chat template.

The template is rendered to text and tokenized with add_special_tokens=False (a template that emits
BOS keeps exactly one; for one that does not, like llava-1.5's, the tokenizer's own BOS is put
back), then each image placeholder is expanded to the exact number of visual tokens of that image. No torch here: the coordinator uses this at admission.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mserve.common.protocol.client import MediaRef
from mserve.common.audio import AudioInfo, AudioPart, audio_part_from_content, read_audio_header
from mserve.common.model import ModelFamily, VideoInfo, load_family
from mserve.common.images import image_size_from_header
from mserve.common.video import VideoPart, describe_video, payload_bytes, video_part_from_value


@dataclass
class PreparedPrompt:
    prompt_ids: list[int]  # placeholders expanded
    images: list[bytes | VideoPart | AudioPart]  # images, videos and audio clips, in prompt order
    image_sizes: list[tuple[int, int] | VideoInfo | AudioInfo]
    text: str


def load_chat_template(model_dir: str | os.PathLike, tokenizer: Any) -> str:
    """The processor's chat template (llava-hf and Qwen2-VL keep it beside the processor)."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "chat_template.json").is_file():
        return json.loads((d / "chat_template.json").read_text())["chat_template"]
    for name in ("processor_config.json", "tokenizer_config.json"):
        p = d / name
        if p.is_file():
            tmpl = json.loads(p.read_text()).get("chat_template")
            if isinstance(tmpl, str):
                return tmpl
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise ValueError(f"{model_dir} has no chat template (chat_template.jinja / chat_template.json)")


def image_bytes_from_part(part: dict[str, Any], allow_paths: bool = True) -> bytes:
    """Image content part -> bytes. Accepts raw bytes, a data URL (OpenAI shape), or a file path.

    A server passes allow_paths=False: a client must never make it read its own local files.
    """
    value = part.get("image")
    if value is None and "image_url" in part:
        url = part["image_url"]
        value = url.get("url") if isinstance(url, dict) else url
    if not isinstance(value, (bytes, bytearray, memoryview, str)):
        raise ValueError(f"image part has no usable image (got {type(value).__name__})")
    return payload_bytes(value, "image", allow_paths)


CHAT_ROLES = ("system", "user", "assistant")  # the turns a chat template is given


def normalize_messages(messages: Sequence[dict[str, Any]],
                       allow_paths: bool = True) -> tuple[list[dict[str, Any]], list[bytes | VideoPart]]:
    """Split images and videos out of the messages; the template only needs to know where they were.

    The second list holds image bytes and `VideoPart`s, in content order.

    Two other walks over a request's messages look alike but sit at other edges and stay apart on
    purpose: the client's (coordinator/client_core.py `normalize_client_messages`) reads the paths
    on the caller's own disk into bytes and keeps each message's shape for the wire; the gateway's
    (mserve/gateway/openai_api.py `convert_messages`) takes OpenAI's HTTP shapes, reads files only
    under its media root and answers OpenAI errors naming the field. This one runs on the server,
    refuses paths, and shapes the turns for the chat template. All three read a part's bytes through
    the same helpers (image_bytes_from_part, video_part_from_value) where their inputs allow it."""
    if not messages:
        raise ValueError("messages is empty")
    out, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a map with role and content")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be system, user or assistant (got {role!r})")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"messages[{i}] has a text part whose text is not a string")
                parts.append({"type": "text", "text": text})
            elif kind in ("image", "video", "audio") and "media" in part:
                # An item in a media store (common/media_store.py): its ref, not its bytes.
                images.append(_stored(part["media"], kind, f"messages[{i}] {kind} part's media"))
                parts.append({"type": kind})
            elif kind in ("image", "image_url"):
                images.append(image_bytes_from_part(part, allow_paths))
                parts.append({"type": "image"})
            elif kind == "video":
                images.append(video_part_from_value(part.get("video"), allow_paths, part.get("fps")))
                parts.append({"type": "video"})
            elif kind in ("audio", "input_audio", "audio_url"):
                images.append(audio_part_from_content(part, allow_paths))
                parts.append({"type": "audio"})
            else:
                raise ValueError(f"messages[{i}] has an unsupported content part type {kind!r}")
        out.append({"role": role, "content": parts})
    return out, images


def _stored(value: Any, kind: str, where: str) -> MediaRef:
    ref = MediaRef.parse(value, where)
    if ref.kind != kind:
        raise ValueError(f"{where} is a stored {ref.kind}, not a {kind} (its kind must be the part's type)")
    return ref


def _videos_as_frames(norm: list[dict[str, Any]], sizes: Any) -> list[dict[str, Any]]:
    """Each {"type": "video"} part -> one {"type": "image"} part per frame (sizes: one entry per image or
    video part, in content order)."""
    out = []
    for msg in norm:
        parts = []
        for p in msg["content"]:
            if p["type"] in ("image", "video"):
                size = next(sizes)
                if p["type"] == "video":
                    parts.extend({"type": "image"} for _ in range(size.num_frames))
                    continue
            parts.append(p)
        out.append({**msg, "content": parts})
    return out


class PromptBuilder:
    """Tokenizer + chat template + family rules for one checkpoint."""

    def __init__(self, model_dir: str | os.PathLike, visual_token_pruning: float | str | None = None) -> None:
        """`visual_token_pruning`: the keep ratio the encoders prune to (common/pruning.py); each
        image then expands to that many placeholders. Raises PruningError for a family that cannot prune."""
        from mserve.common import pruning

        self.model_dir = str(model_dir)
        self.family: ModelFamily = load_family(model_dir)
        self.visual_token_pruning = pruning.apply(self.family, visual_token_pruning)
        self.tokenizer = self.family.processor.tokenizer  # the processor's own: one load, one vocabulary
        self.chat_template = None if self.family.rules.encode_chat is not None else load_chat_template(model_dir, self.tokenizer)
        self.bos_token_id = self._implicit_bos()

    def _implicit_bos(self) -> int | None:
        """The BOS id this tokenizer adds by itself (llava-hf's Llama tokenizer), or None (Qwen)."""
        bos = self.tokenizer.bos_token_id
        with_specials = self.tokenizer("x", add_special_tokens=True)["input_ids"]
        return bos if bos is not None and with_specials and with_specials[0] == bos else None

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)

    def prepare(self, messages: Sequence[dict[str, Any]]) -> PreparedPrompt:
        """Video files are sampled with the defaults of `describe_video` (admission uses its own limits)."""
        norm, items = normalize_messages(messages)
        sizes: list[tuple[int, int] | VideoInfo] = []
        for i, item in enumerate(items):
            if isinstance(item, VideoPart):
                items[i], info = describe_video(item, family=self.family)
                sizes.append(info)
            elif isinstance(item, AudioPart):
                items[i], audio = self.admit_audio(item)
                sizes.append(audio)
            else:
                sizes.append(image_size_from_header(item))
        return self.prepare_normalized(norm, sizes, items)

    def admit_audio(self, part: AudioPart) -> tuple[AudioPart, AudioInfo]:
        """A clip's header read (AudioError when unusable) and its length at the feature extractor's rate fixed."""
        if (why := self.family.audio_unsupported()) is not None:
            raise ValueError(why)
        info = read_audio_header(part.data)
        return AudioPart(part.data, info.resampled_samples(self.family.audio_features.sampling_rate)), info

    def prepare_normalized(self, norm: list[dict[str, Any]], sizes: Sequence[tuple[int, int] | VideoInfo],
                           images: Sequence[bytes | VideoPart], keep_ratio: float | None = None) -> PreparedPrompt:
        """Messages already split from their images and videos (see normalize_messages), sizes known
        (a VideoInfo for each video). `keep_ratio`: this request's pruning ratio, else the builder's."""
        if any(isinstance(s, AudioInfo) for s in sizes) and (why := self.family.audio_unsupported()) is not None:
            raise ValueError(why)
        if not any(p.get("text", "").strip() for m in norm for p in m["content"] if p["type"] == "text") and not images:
            raise ValueError("prompt is empty: no text and no image")
        if any(isinstance(s, tuple) for s in sizes) and (why := self.family.image_unsupported()) is not None:
            raise ValueError(why)
        if any(isinstance(s, VideoInfo) for s in sizes):
            if (why := self.family.video_unsupported()) is not None:
                raise ValueError(why)
            if self.family.video_as_frames:  # LLaVA: each frame is an image part of its own
                norm = _videos_as_frames(norm, iter(sizes))
        if self.family.rules.encode_chat is not None:  # a tokenizer that encodes the chat itself (Voxtral's)
            ids = self.family.rules.encode_chat(self.tokenizer, norm, self.family.audio_token_id)
            ids = self.family.expand_placeholders(ids, self.family.placeholder_sizes(sizes), keep_ratio)
            return PreparedPrompt(ids, list(images), list(sizes), self.tokenizer.decode(ids))
        text = self.render(norm)
        expanded_text = text
        if self.family.rules.expand_text is not None:  # its processor expands each image as text (Gemma 3)
            expanded_text = self.family.rules.expand_text(text, self.family.processor, len(sizes))
        elif self.family.timestamped_video and any(isinstance(s, VideoInfo) for s in sizes):
            expanded_text = self._expand_timestamped(text, sizes, keep_ratio)
        ids = self.tokenizer(expanded_text, add_special_tokens=False)["input_ids"]
        # Templates that emit BOS themselves are tokenized as they are; the published llava-1.5
        # template does not, and its model was trained with the BOS its tokenizer adds: keep it.
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        if expanded_text is not text:
            self._check_runs(ids, sizes)
        else:
            ids = self.family.expand_placeholders(ids, self.family.placeholder_sizes(sizes), keep_ratio)
        return PreparedPrompt(ids, list(images), list(sizes), text)

    def _expand_timestamped(self, text: str, sizes: Sequence[tuple[int, int] | VideoInfo],
                            keep_ratio: float | None) -> str:
        """Qwen3-VL: the rendered prompt with every placeholder expanded as text, as Qwen3VLProcessor does
        before tokenizing (a video: "<t seconds>" and one vision_start ... vision_end run per frame group,
        the template's own wrapper around the video collapsed into that)."""
        from mserve.common.families import qwen3_vl

        proc, family = self.family.processor, self.family
        text = text.replace(qwen3_vl.video_wrapper(proc), proc.video_token)
        pieces = re.split(f"({re.escape(proc.image_token)}|{re.escape(proc.video_token)})", text)
        items, out = iter(sizes), []
        for piece in pieces:
            if piece not in (proc.image_token, proc.video_token):
                out.append(piece)
                continue
            kind, size = ("video" if piece == proc.video_token else "image"), next(items, None)
            if size is None or isinstance(size, VideoInfo) != (kind == "video"):
                raise ValueError(f"the chat template placed a {kind} placeholder where the request has "
                                 f"{'no more items' if size is None else 'another kind'}")
            if kind == "image":
                out.append(piece * family.visual_token_count(size, keep_ratio))
                continue
            if size.frame_seconds is None or len(size.frame_seconds) != size.num_frames:
                raise ValueError("a Qwen3-VL video needs each frame's time (VideoInfo.frame_seconds)")
            t, h, w = family.video_grid(size)
            out.append(qwen3_vl.video_text(proc, size.frame_seconds, family.video_config["temporal_patch_size"],
                                           h * w // family.video_config["merge_size"] ** 2))
        if next(items, None) is not None:
            raise ValueError("prompt has fewer image and video placeholders than images and videos")
        return "".join(out)

    def _check_runs(self, ids: list[int], sizes: Sequence[tuple[int, int] | VideoInfo]) -> None:
        """A prompt expanded as text has one placeholder run per image (a Qwen3-VL video: consecutive runs,
        one per frame group), adding up to that item's count."""
        from mserve.common.hashing import item_spans

        runs = self.family.image_spans(ids)
        expected = [self.family.visual_token_count(s) for s in sizes]
        try:
            item_spans(runs, [("", n) for n in expected])
        except ValueError:
            raise ValueError(f"{self.family.model_type}: the prompt's image placeholder runs {[n for _, n in runs]} "
                             f"do not match its images' token counts {expected}") from None

    def prepare_text(self, prompt: str, images: Sequence[bytes] = (), audio: Sequence[bytes] = ()) -> PreparedPrompt:
        """One user turn: the images first, then the audio clips, then the text (the llava-1.5 / Qwen2-VL /
        Qwen2-Audio convention)."""
        if not prompt.strip() and not images and not audio:
            raise ValueError("prompt is empty: give --prompt text or at least one image")
        content: list[dict[str, Any]] = [{"type": "image", "image": b} for b in images]
        content.extend({"type": "audio", "audio": b} for b in audio)
        content.append({"type": "text", "text": prompt})
        return self.prepare([{"role": "user", "content": content}])

    def decode(self, token_ids: Sequence[int]) -> str:
        return detokenize(self.tokenizer, token_ids)


def detokenize(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Token ids -> the text a reply shows (special tokens dropped): the coordinator's final text and the
    gateway's streamed deltas (mserve/gateway/textstream.py) both come from here, so they always agree."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
