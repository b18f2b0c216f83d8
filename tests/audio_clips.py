"""Audio files for tests, written offline: WAV with the stdlib, FLAC / MP3 / Ogg Opus with PyAV."""

from __future__ import annotations

import io

import numpy as np

from mserve.bench.media_files import pcm16_wav

CODECS = {"wav": None, "flac": "flac", "mp3": "libmp3lame", "ogg": "libopus"}


def tone(samples: int, rate: int, seed: int = 0) -> np.ndarray:
    """A float32 clip: two tones and a little noise (so different seeds give different features)."""
    t = np.arange(samples) / rate
    rng = np.random.default_rng(seed)
    f1, f2 = 200 + 50 * seed, 1300 + 70 * seed
    x = 0.3 * np.sin(2 * np.pi * f1 * t) + 0.2 * np.sin(2 * np.pi * f2 * t) + 0.02 * rng.standard_normal(samples)
    return x.astype(np.float32)


def make_audio(samples: int, rate: int = 16000, fmt: str = "wav", seed: int = 0) -> bytes:
    """`samples` samples of `tone` at `rate`, as a `fmt` file (wav, flac, mp3, ogg)."""
    x = tone(samples, rate, seed)
    if fmt == "wav":
        return pcm16_wav(x, rate)
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(CODECS[fmt], rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(x[None], format="flt", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        resampler = av.AudioResampler(format=stream.codec_context.codec.audio_formats[0].name, layout="mono", rate=rate)
        for part in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(part):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()
