"""Image bytes as the server reads them: the size from the header alone (no pixel decoded), the content hash
caches key on, and decoding with the pixel limit checked first; PIL's own decompression-bomb guard moves
here so our limits can name themselves."""

from __future__ import annotations

import hashlib
import io

from PIL import Image


class ImageError(ValueError):
    """An image the user sent cannot be used (corrupt, unsupported, over a limit)."""


def image_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def image_size_from_header(data: bytes) -> tuple[int, int]:
    """(width, height) read from the header only: PIL's open() does not decode pixels."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception as exc:  # PIL raises many types for bad input
        raise ImageError(f"cannot read image header: {exc.__class__.__name__}: {exc}") from exc


# PIL's own decompression-bomb guard would refuse a huge header before our limits could name
# themselves; every decode below checks a pixel limit (at most PIL's) before decoding, so the
# guard is moved here: reading a header decodes nothing.
PIL_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 178956970
Image.MAX_IMAGE_PIXELS = None


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Decode image bytes to RGB, checking the pixel limit (default: PIL's bomb guard) before any pixel
    is decoded."""
    width, height = image_size_from_header(data)
    if max_pixels is None and width * height > PIL_MAX_PIXELS:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the decompression-bomb "
                         f"guard of {PIL_MAX_PIXELS} pixels")
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the limit max_image_pixels={max_pixels}")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except Exception as exc:
        raise ImageError(f"cannot decode image ({width}x{height}): {exc.__class__.__name__}: {exc}") from exc
