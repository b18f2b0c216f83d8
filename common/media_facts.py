"""A stored media item's header facts: what a media store reads from the bytes it publishes, and what a
worker checks the bytes it pulled against.

Admission counts an item's tokens from these facts alone (coordinator/admission.py), with the model's
own rules, so they are the raw facts of the header, nothing a model's settings decide: an image's
(width, height); an audio clip's sample rate and samples per channel (common/audio.py AudioInfo); a
video file's frame size, frame count and rate (common/video.py VideoProbe). The worker reads them
again from the bytes it pulled: a request admitted on facts its bytes do not have fails, naming the
fact, before anything is decoded.
"""

from __future__ import annotations

from typing import Any

from mserve.common.audio import read_audio_header
from mserve.common.images import ImageError, image_hash, image_size_from_header
from mserve.common.protocol.client import MediaRef
from mserve.common.video import probe_video


class MediaError(ImageError):
    """A media item could not be pulled, or its bytes are not what its ref says."""


def read_facts(kind: str, data: bytes) -> dict[str, Any]:
    """The MediaRef fields of a `kind` item read from its header (no pixel or sample decoded). ImageError
    when the header cannot be read."""
    if kind == "image":
        return {"size": list(image_size_from_header(data))}
    if kind == "audio":
        info = read_audio_header(data)
        return {"size": [0, 0], "sample_rate": info.sample_rate, "samples": info.samples}
    probe = probe_video(data)
    return {"size": [probe.width, probe.height], "frames": probe.total_frames, "fps": probe.fps or 0.0}


def _said(ref: MediaRef, facts: dict[str, Any]) -> str:
    if ref.kind == "image":
        return f"the image is {facts['size'][0]}x{facts['size'][1]}, the request said size={ref.size[0]}x{ref.size[1]}"
    wrong = [name for name, value in facts.items() if getattr(ref, name) != value]
    return ", ".join(f"its {name} is {facts[name]!r}, the request said {name}={getattr(ref, name)!r}" for name in wrong)


def check_facts(ref: MediaRef, data: bytes, where: str) -> None:
    """The bytes against the header facts the request was admitted on; MediaError naming the fact."""
    if len(data) != ref.nbytes:
        raise MediaError(f"{where}: its bytes do not match its header facts: {len(data)} bytes, "
                         f"the request said nbytes={ref.nbytes}")
    if image_hash(data) != ref.hash:
        raise MediaError(f"{where}: its bytes do not match its header facts: their hash is {image_hash(data)}")
    try:
        facts = read_facts(ref.kind, data)
    except ImageError as exc:
        raise MediaError(f"{where}: its header cannot be read: {exc}") from None
    if any(getattr(ref, name) != value for name, value in facts.items()):
        raise MediaError(f"{where}: its bytes do not match its header facts: {_said(ref, facts)} "
                         "(its tokens were counted from that)")
