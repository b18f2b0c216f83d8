"""Documents in requests: a PDF rendered page by page into PNG images (pypdfium2).

A document becomes its pages, each an ordinary image part, in page order; nothing after the edge knows it
was a document. So admission counts a page's tokens as it counts any image's, and a page already sent (as
an image, or in another document) hashes the same and hits the embedding caches and the prefix cache:
the same page renders to the same PNG bytes every time (one renderer, fixed settings, no metadata).

Resolution: each page is rendered at `DocumentLimits.dpi` dots per inch (default 96: a US-letter page is
816 x 1056 pixels, under a megapixel), scaled down where needed so that its longer side is at most
MAX_PAGE_SIDE_PX. The model's own processor then resizes the page as it resizes every image (llava to its
fixed square, Qwen2-VL within its min/max pixels), exactly as when the same PNG is sent as an image;
an operator whose model wants more (or fewer) pixels per page sets the gateway's --document-dpi.

Refused before any page is rendered, each with a message naming the field and the limit: not a PDF
(no ``%PDF-`` header), a body over `max_bytes`, a file PDFium cannot open (corrupt or truncated), an
encrypted one (any security handler, a password or not), more than `max_pages` pages, a page box
(points, 1/72 inch) with a side over MAX_PAGE_POINTS (PDF's own implementation limit) or under 1 point.
So a PDF bomb (many pages, huge page boxes) costs a header parse, not a render.

Needs pypdfium2 (``pip install 'mserve[documents]'``); imported only when a document arrives.
PDFium is not thread-safe: every use here holds one lock (the gateway renders on worker threads).
"""

from __future__ import annotations

import io
import os
import threading
from dataclasses import dataclass

DOCUMENTS_EXTRA = "documents"  # the optional dependency group that installs pypdfium2
PDF_MIME = "application/pdf"
# The coordinator's max_images_per_request (8 by default, common/policy.py) counts a document's pages
# as images: a default above it would only move the refusal past the gateway.
MAX_DOCUMENT_PAGES = 8
MAX_DOCUMENT_BYTES = 32 * 1024 * 1024
DEFAULT_DOCUMENT_DPI = 96
MAX_PAGE_SIDE_PX = 2048
MAX_PAGE_POINTS = 14400  # 200 inches: ISO 32000-1 Annex C's largest page
_HEADER_WINDOW = 1024  # the header may follow up to 1 KiB of junk (ISO 32000-1 7.5.2 implementations allow)

_PDFIUM_LOCK = threading.Lock()


class DocumentError(ValueError):
    """A document the user sent cannot be used; the message names the field and the limit."""


@dataclass(frozen=True)
class DocumentLimits:
    max_pages: int = MAX_DOCUMENT_PAGES
    max_bytes: int = MAX_DOCUMENT_BYTES
    dpi: int = DEFAULT_DOCUMENT_DPI

    def __post_init__(self) -> None:
        for name in ("max_pages", "max_bytes", "dpi"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"document limit {name} must be a positive integer, got {value!r}")


def _pdfium():
    try:
        import pypdfium2
        import pypdfium2.raw
    except ImportError:
        raise DocumentError(f"documents need pypdfium2, which is not installed here "
                            f"(pip install 'mserve[{DOCUMENTS_EXTRA}]')") from None
    return pypdfium2, pypdfium2.raw


def check_header(data: bytes, field: str = "document", max_bytes: int = MAX_DOCUMENT_BYTES) -> None:
    """Refuse what is not a PDF or is over the byte limit, without parsing anything."""
    if len(data) > max_bytes:
        raise DocumentError(f"{field}: the document is {len(data)} bytes, over the limit max_document_bytes={max_bytes}")
    if b"%PDF-" not in data[:_HEADER_WINDOW]:
        raise DocumentError(f"{field}: not a PDF (no %PDF- header); only PDF documents ({PDF_MIME}) are supported")


def page_scale(width_pt: float, height_pt: float, dpi: int) -> float:
    """Pixels per point for a page of that box: `dpi`/72, less where the longer side would pass MAX_PAGE_SIDE_PX."""
    return min(dpi / 72.0, MAX_PAGE_SIDE_PX / max(width_pt, height_pt))


def render_pdf(data: bytes, limits: DocumentLimits = DocumentLimits(), field: str = "document") -> list[bytes]:
    """The document's pages as PNG bytes, in order; DocumentError names the field and the limit for a
    document that is not one, cannot be read, or is over a limit (all checked before the first render)."""
    data = bytes(data)
    check_header(data, field, limits.max_bytes)
    pdfium, raw = _pdfium()
    with _PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            if getattr(exc, "err_code", None) == raw.FPDF_ERR_PASSWORD:
                raise DocumentError(f"{field}: the PDF is encrypted (password-protected); encrypted documents "
                                    "are not supported") from None
            raise DocumentError(f"{field}: the PDF cannot be read (corrupt or truncated): {exc}") from None
        try:
            if raw.FPDF_GetSecurityHandlerRevision(pdf.raw) != -1:
                raise DocumentError(f"{field}: the PDF is encrypted; encrypted documents are not supported")
            n = len(pdf)
            if n < 1:
                raise DocumentError(f"{field}: the PDF has no pages")
            if n > limits.max_pages:
                raise DocumentError(f"{field}: the document has {n} pages, over the limit "
                                    f"max_document_pages={limits.max_pages}")
            boxes = []
            for i in range(n):
                w, h = pdf.get_page_size(i)
                if not (1 <= w <= MAX_PAGE_POINTS and 1 <= h <= MAX_PAGE_POINTS):
                    raise DocumentError(f"{field}: page {i + 1} is {w:g} x {h:g} points; each side must be within "
                                        f"1..{MAX_PAGE_POINTS} points (max_page_points={MAX_PAGE_POINTS})")
                boxes.append((w, h))
            return [_render_page(pdf, i, page_scale(w, h, limits.dpi), field) for i, (w, h) in enumerate(boxes)]
        except pdfium.PdfiumError as exc:
            raise DocumentError(f"{field}: the PDF cannot be read (corrupt): {exc}") from None
        finally:
            pdf.close()


def render_pdf_file(path: str | os.PathLike, limits: DocumentLimits = DocumentLimits(), field: str = "document"
                    ) -> list[bytes]:
    """render_pdf of a file on this machine's disk (the client's and `mserve generate`'s documents)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_bytes:  # not read
                raise DocumentError(f"{field}: the document is {size} bytes, over the limit "
                                    f"max_document_bytes={limits.max_bytes}")
            data = f.read()
    except OSError as exc:
        raise DocumentError(f"{field}: no such file" if isinstance(exc, FileNotFoundError) else f"{field}: {exc}") from None
    return render_pdf(data, limits, field)


def _render_page(pdf, index: int, scale: float, field: str) -> bytes:
    page = pdf[index]
    try:
        image = page.render(scale=scale, may_draw_forms=False).to_pil().convert("RGB")
    finally:
        page.close()
    if min(image.size) < 1:
        raise DocumentError(f"{field}: page {index + 1} renders to {image.size[0]} x {image.size[1]} pixels")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
