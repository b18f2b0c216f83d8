"""Image bytes for traces: real photographs resized to exact sizes, or seeded synthetic fallbacks."""

from __future__ import annotations

import io
import logging
import math

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# (width, height) -> weight. Weights peak around 512..1024 because that is what
# phone uploads and screenshots look like after client-side downscaling; the
# tails (thumbnails, 4K) are rare but exist and stress the encoder differently.
IMAGE_RESOLUTIONS: tuple[tuple[tuple[int, int], float], ...] = (
    ((128, 128), 0.04),
    ((224, 224), 0.08),
    ((336, 336), 0.12),
    ((512, 512), 0.16),
    ((640, 480), 0.18),
    ((1024, 768), 0.16),
    ((1280, 720), 0.12),
    ((1920, 1080), 0.08),
    ((2560, 1440), 0.03),
    ((3840, 2160), 0.03),
)

# Frame sizes of the `video` trace: what phone clips and web video look like once downscaled for upload.
VIDEO_RESOLUTIONS: tuple[tuple[tuple[int, int], float], ...] = (
    ((640, 360), 0.3),
    ((854, 480), 0.4),
    ((1280, 720), 0.3),
)
PAN_PX_PER_FRAME = 8  # a clip's frames are a window panning across one source image

# Photographs bundled inside the scikit-image wheel (no network needed).
PHOTO_NAMES = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")
NUM_SYNTHETIC_PATTERNS = 5


class ImageFactory:
    """Builds image bytes; caches resized base pixels so big traces stay fast.

    With distinct=True every image slot gets a unique pixel stamp so a serving
    system's content-hash encoder cache only hits where the trace really resends
    an image (multiturn), not because two users happened to pick the same photo.
    """

    def __init__(self, rng: np.random.Generator, use_photos: bool, distinct: bool) -> None:
        self.rng = rng
        self.distinct = distinct
        self.photos: list[np.ndarray] = _load_photos() if use_photos else []
        self.salt = int(rng.integers(0, 2**32))
        self._base: dict[tuple[int, int, int], np.ndarray] = {}
        self._encoded: dict[tuple[int, int, int], bytes] = {}
        self._slot = 0

    @property
    def num_sources(self) -> int:
        return len(self.photos) or NUM_SYNTHETIC_PATTERNS

    def make(self, size: tuple[int, int]) -> bytes:
        source = int(self.rng.integers(0, self.num_sources))
        key = (source, size[0], size[1])
        if not self.distinct and key in self._encoded:
            return self._encoded[key]
        if key not in self._base:
            self._base[key] = self._render(source, size)
        pixels = self._base[key]
        if self.distinct:
            pixels = _stamp(pixels, (self.salt << 32) | self._slot)
            self._slot += 1
        data = _encode(pixels, jpeg=bool(self.photos))
        if not self.distinct:
            self._encoded[key] = data
        return data

    def make_frames(self, size: tuple[int, int], count: int) -> list[bytes]:
        """The frames of one clip of `count` frames of `size`: a window panning PAN_PX_PER_FRAME pixels per
        frame across one source, so consecutive frames are alike as in real video (each stamped when distinct)."""
        w, h = size
        source = int(self.rng.integers(0, self.num_sources))
        key = (source, w + PAN_PX_PER_FRAME * (count - 1), h)
        if key not in self._base:
            self._base[key] = self._render(source, key[1:])
        wide, frames = self._base[key], []
        for k in range(count):
            pixels = np.ascontiguousarray(wide[:, PAN_PX_PER_FRAME * k : PAN_PX_PER_FRAME * k + w])
            if self.distinct:
                pixels = _stamp(pixels, (self.salt << 32) | self._slot)
                self._slot += 1
            frames.append(_encode(pixels, jpeg=bool(self.photos)))
        return frames

    def _render(self, source: int, size: tuple[int, int]) -> np.ndarray:
        if self.photos:
            return _fit(self.photos[source], size)
        return _synthetic(source, size)


def _load_photos() -> list[np.ndarray]:
    try:
        import skimage.data as skdata
    except ImportError:
        log.info("scikit-image not installed; using synthetic images")
        return []
    photos = []
    for name in PHOTO_NAMES:
        try:
            arr = np.asarray(getattr(skdata, name)())
        except Exception as exc:  # a missing sample must not break trace building
            log.info("skimage sample %s unavailable (%s); skipping", name, exc)
            continue
        if arr.ndim == 3 and arr.shape[2] == 3 and arr.dtype == np.uint8:
            photos.append(arr)
    if not photos:
        log.info("no usable skimage photos; using synthetic images")
    return photos


def _fit(photo: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Center-crop to the target aspect ratio, then resize to exactly `size`."""
    w, h = size
    ph, pw = photo.shape[:2]
    if pw * h > ph * w:  # too wide
        cw, ch = max(1, round(ph * w / h)), ph
    else:
        cw, ch = pw, max(1, round(pw * h / w))
    x0, y0 = (pw - cw) // 2, (ph - ch) // 2
    img = Image.fromarray(photo[y0 : y0 + ch, x0 : x0 + cw]).resize((w, h), Image.BICUBIC)
    return np.asarray(img)


def _synthetic(pattern: int, size: tuple[int, int]) -> np.ndarray:
    """Seeded gradient plus noise at an exact size, as a mosaic of 16 px cells.

    Computing at cell resolution and upscaling keeps 4K frames fast to build,
    and the blocky noise keeps the PNG a realistic size (per-pixel noise gives
    ~18 MB for 4K).
    """
    w, h = size
    cw, ch = w // 16 + 1, h // 16 + 1
    rng = np.random.default_rng([pattern, w, h])
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    theta = rng.uniform(0, 2 * math.pi)
    t = np.add.outer(np.linspace(0, math.sin(theta), ch), np.linspace(0, math.cos(theta), cw))
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    cells = c0 + (c1 - c0) * t[..., None] + rng.normal(0, 24, (ch, cw, 3))
    small = Image.fromarray(np.clip(cells, 0, 255).astype(np.uint8))
    return np.asarray(small.resize((cw * 16, ch * 16), Image.NEAREST))[:h, :w]


def _stamp(pixels: np.ndarray, ident: int) -> np.ndarray:
    """Copy with 8 small blocks in the bottom-right corner encoding `ident`."""
    out = pixels.copy()
    h, w = out.shape[:2]
    bs = max(1, min(4, w // 8, h))
    for i in range(8):
        value = (ident >> (8 * i)) & 0xFF
        x0 = w - bs * (8 - i)
        out[h - bs : h, max(0, x0) : max(0, x0 + bs)] = value
    return out


def _encode(pixels: np.ndarray, jpeg: bool) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(pixels)
    if jpeg:
        img.save(buf, "JPEG", quality=90)
    else:
        img.save(buf, "PNG", compress_level=1)  # encode speed matters more than size
    return buf.getvalue()
