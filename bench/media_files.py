"""The audio clips and PDFs the bench's traces send, as the files a client would upload: a few tones
and noise as a WAV, images as a PDF's pages. The same draws make the same bytes."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def wav_of(rng: np.random.Generator, seconds: float, rate: int) -> bytes:
    """A mono 16-bit WAV of `seconds`: a few tones and some noise drawn from `rng` (the same draws, the same
    bytes), so each clip is distinct and its encoder work is real."""
    t = np.arange(int(seconds * rate)) / rate
    signal = sum(0.2 * np.sin(2 * np.pi * f * t) for f in rng.uniform(110, 1800, size=3))
    return pcm16_wav(signal + 0.05 * rng.standard_normal(t.shape), rate)


def pcm16_wav(signal: np.ndarray, rate: int) -> bytes:
    """A mono float signal in [-1, 1] (clipped) as a 16-bit PCM WAV file."""
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(signal, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def pdf_of(pages: Sequence[bytes]) -> bytes:
    """The images as one PDF's pages (Pillow writes it), sized so that the gateway's default rendering
    (common/documents.py, DEFAULT_DOCUMENT_DPI) gives each page back at its image's pixel size; fixed
    dates, so the same pages are the same bytes."""
    import io
    import time

    from PIL import Image

    from mserve.common.documents import DEFAULT_DOCUMENT_DPI

    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pages]
    when = time.gmtime(1735689600)  # 2025-01-01
    out = io.BytesIO()
    images[0].save(out, format="PDF", save_all=True, append_images=images[1:], resolution=float(DEFAULT_DOCUMENT_DPI),
                   creationDate=when, modDate=when)
    return out.getvalue()
