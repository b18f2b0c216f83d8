"""Audio clips: what admission reads from a container's header (no sample decoded) and what an encode
worker decodes.

A clip's length is fixed at admission from its container (its duration and sample rate, and a demux of
its packets, which decodes nothing): `AudioInfo.samples` at the file's rate, and `resampled_samples` at
the feature extractor's rate. The encode worker decodes and resamples to that rate and then holds the
waveform to exactly that many samples (a resampler's flush may differ by a sample or two), so the token
count admission computed is the count of the waveform the audio tower sees.
"""

from __future__ import annotations

import hashlib
import io
import struct
from dataclasses import dataclass

import numpy as np

from mserve.common.images import ImageError

# A clip whose packets end this much (in seconds) before its header's duration is truncated.
TRUNCATION_SLACK_S = 0.05


class AudioError(ImageError):
    """An audio clip the user sent cannot be used (corrupt, truncated, unknown codec)."""


@dataclass(frozen=True)
class AudioInfo:
    """What a clip's token count depends on, from its container: samples per channel at `sample_rate`."""

    sample_rate: int
    samples: int
    codec: str

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate

    def resampled_samples(self, rate: int) -> int:
        """The clip's length at `rate` (rounded up: a partial sample counts)."""
        return -(-self.samples * rate // self.sample_rate)


@dataclass(frozen=True)
class AudioPart:
    """One audio clip of a request: the file's bytes and, once admitted, its length in samples at the
    feature extractor's rate (AudioInfo.resampled_samples), which the encode worker holds it to."""

    data: bytes
    samples: int | None = None


def audio_hash(part: AudioPart) -> str:
    """What caches key a clip on: its bytes, and the length it is held to (two lengths, two encodings)."""
    return audio_key(hashlib.blake2b(part.data, digest_size=16).hexdigest(), part.samples)


def audio_key(content_hash: str, samples: int | None) -> str:
    """`audio_hash` from the bytes' blake2b-128 (common/images.py image_hash), as a media store's ref
    carries it: an inline and a stored copy of one clip share their cache entries."""
    return hashlib.blake2b(b"audio:%d:%s" % (samples or 0, content_hash.encode()), digest_size=16).hexdigest()


def _riff_truncation(data: bytes) -> str | None:
    """A WAV whose data chunk says more bytes than the file holds (ffmpeg's demuxer quietly shortens it)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if kind == b"data":
            have = len(data) - pos - 8
            if size not in (0, 0xFFFFFFFF) and size > have:  # 0 / all ones: a streamed WAV states no size
                return f"truncated: its data chunk says {size} bytes, the file holds {have}"
            return None
        pos += 8 + size + (size & 1)
    return None


def read_audio_header(data: bytes) -> AudioInfo:
    """The clip's sample rate and length from its container, demuxing its packets but decoding none.
    AudioError names a file that is not audio, truncated, or in a codec this host cannot decode."""
    import av

    if (why := _riff_truncation(data)) is not None:
        raise AudioError(why)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            stream = container.streams.audio[0]
            ctx = stream.codec_context
            if ctx is None:
                raise AudioError("unknown codec: the audio stream's codec has no decoder on this host")
            rate = int(ctx.sample_rate or 0)
            if rate <= 0:
                raise AudioError("the file states no sample rate")
            end = 0.0  # where the last packet ends, in seconds
            for packet in container.demux(stream):
                if packet.size and packet.pts is not None and packet.time_base is not None:
                    end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
            start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
            if stream.duration is not None and stream.time_base is not None:
                header_s = float(stream.duration * stream.time_base)
                if end - start < header_s - TRUNCATION_SLACK_S:
                    raise AudioError(f"truncated: its header says {header_s:.3f} s, its packets end at "
                                     f"{end - start:.3f} s")
            else:  # no duration in the header (a streamed file): the packets say it
                header_s = end - start
            samples = round(header_s * rate)
            if ctx.name == "opus":  # Ogg Opus counts its pre-skip (the decoder drops it) in the duration
                samples -= int(ctx.delay or 0)
            return AudioInfo(sample_rate=rate, samples=max(samples, 0), codec=ctx.name)
    except AudioError:
        raise
    except Exception as exc:  # PyAV raises many types for bad input
        raise AudioError(f"cannot read the audio container: {exc.__class__.__name__}: {exc}") from exc


def decode_audio(data: bytes, rate: int, samples: int | None = None) -> np.ndarray:
    """The clip as mono float32 at `rate`, held to `samples` samples (AudioInfo.resampled_samples:
    the length admission counted) by cutting or zero-padding the resampler's last few."""
    import av

    try:
        chunks: list[np.ndarray] = []
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        with av.open(io.BytesIO(data), mode="r") as container:
            for frame in container.decode(audio=0):
                chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
        chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except Exception as exc:
        raise AudioError(f"cannot decode audio: {exc.__class__.__name__}: {exc}") from exc
    wave = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples is None:
        return wave
    if len(wave) >= samples:
        return wave[:samples]
    return np.concatenate([wave, np.zeros(samples - len(wave), np.float32)])


AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")  # OpenAI input_audio's "format" values taken (PyAV reads the file)


def audio_part_from_content(part: dict, allow_paths: bool = True) -> AudioPart:
    """An audio content part -> AudioPart: mserve's {"type": "audio", "audio": bytes | data URL | path},
    OpenAI's {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}} or vLLM's
    {"type": "audio_url", "audio_url": {"url": data URL}}."""
    import base64
    import binascii

    from mserve.common.video import payload_bytes

    kind = part.get("type")
    if kind == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, dict) or not isinstance(body.get("data"), str):
            raise ValueError("input_audio must be a map with data (base64) and format")
        if body.get("format") not in AUDIO_FORMATS:
            raise ValueError(f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)} (got {body.get('format')!r})")
        try:
            return AudioPart(base64.b64decode(body["data"], validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"input_audio.data is not valid base64: {exc}") from None
    value = part.get("audio")
    if value is None and kind == "audio_url":
        url = part.get("audio_url")
        value = url.get("url") if isinstance(url, dict) else url
    return AudioPart(payload_bytes(value, "audio", allow_paths))
