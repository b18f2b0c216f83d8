"""Documents in requests: a PDF rendered page by page into PNG images (pypdfium2).

A document becomes its pages, each an ordinary image part, in page order; nothing after the edge knows it
was a document. So admission counts a page's tokens as it counts any image's, and a page already sent (as
an image, or in another document) hashes the same and hits the embedding caches and the prefix cache:
the same page renders to the same PNG bytes every time (one renderer, fixed settings, no metadata).

Resolution: a page renders at the pixel budget of the serving model's image processor where one is known
(`page_budget`, one rule per processor kind, read from the checkpoint's processor settings), so that the
processor neither throws away nor invents pixels (up to its own rounding, and the stretch or crop of a
fixed-size kind to its shape); else (the Python client, which knows no model, or a
model without image processor settings) at `DocumentLimits.dpi` dots per inch (DEFAULT_DOCUMENT_DPI, 96: a
US-letter page is 816 x 1056 pixels). An explicit `dpi` (the gateway's --document-dpi) wins over the
budget. A budget never renders a page under MIN_DOCUMENT_DPI (72: one pixel per point, 10-point text 10
pixels tall, still legible; the processor then resizes it down), and no page's longer side is ever over
MAX_PAGE_SIDE_PX (the cap wins over the floor).
The model's processor then resizes the page as it resizes every image, exactly as when the same PNG is
sent as an image; the same PDF for the same model renders to the same bytes, so cache hits keep working.

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
from typing import Any, NamedTuple

DOCUMENTS_EXTRA = "documents"  # the optional dependency group that installs pypdfium2
PDF_MIME = "application/pdf"
# The coordinator's max_images_per_request (8 by default, common/policy.py) counts a document's pages
# as images: a default above it would only move the refusal past the gateway.
MAX_DOCUMENT_PAGES = 8
MAX_DOCUMENT_BYTES = 32 * 1024 * 1024
DEFAULT_DOCUMENT_DPI = 96  # where no model's budget applies (module docstring)
MIN_DOCUMENT_DPI = 72  # the legibility floor under any budget
MAX_PAGE_SIDE_PX = 2048
MAX_PAGE_POINTS = 14400  # 200 inches: ISO 32000-1 Annex C's largest page
_HEADER_WINDOW = 1024  # the header may follow up to 1 KiB of junk (ISO 32000-1 7.5.2 implementations allow)

_PDFIUM_LOCK = threading.Lock()


class DocumentError(ValueError):
    """A document the user sent cannot be used; the message names the field and the limit."""


class PageBudget(NamedTuple):
    """How many pixels a page gets, as the model's image processor keeps them: `value` is a pixel count
    (kind "pixels": the page's area) or a side in pixels (kind "longest_edge" / "shortest_edge")."""
    kind: str
    value: int


@dataclass(frozen=True)
class DocumentLimits:
    max_pages: int = MAX_DOCUMENT_PAGES
    max_bytes: int = MAX_DOCUMENT_BYTES
    dpi: int = DEFAULT_DOCUMENT_DPI
    budget: PageBudget | None = None  # the model's (page_budget); None: render at `dpi`

    def __post_init__(self) -> None:
        for name in ("max_pages", "max_bytes", "dpi"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"document limit {name} must be a positive integer, got {value!r}")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def page_budget(proc: dict[str, Any]) -> PageBudget | None:
    """The pixels an image processor keeps of an image, from its settings (read_image_processor_config);
    None where no rule fits (pages then render at the DPI default). One rule per kind, first match wins:
    Qwen2-VL-style pixel bounds (max_pixels, or size.longest_edge beside temporal_patch_size): that many pixels
    (GLM-4V's: over temporal_patch_size, its smart_resize counting an image as that many frames);
    Gemma 4's soft-token cap: max_soft_tokens x (patch_size x pooling_kernel_size)^2 pixels; tiles of a fixed
    size (InternVL's crop_to_patches, Llama 4): max_patches x tile height x width pixels; LLaVA-NeXT's any-res
    canvases: the largest image_grid_pinpoints area; a longest edge (Pixtral, Idefics3 / SmolVLM): the page's
    longer side; a fixed height x width (Gemma 3, SigLIP): that area; a shortest edge (CLIP, LLaVA): the
    page's shorter side."""
    size = proc.get("size") if isinstance(proc.get("size"), dict) else {}
    if "max_pixels" in proc or "temporal_patch_size" in proc:
        pixels = _positive(proc.get("max_pixels")) or _positive(size.get("longest_edge"))
        if pixels and str(proc.get("image_processor_type", "")).startswith("Glm4v"):  # an image counted as 2 frames
            pixels //= _positive(proc.get("temporal_patch_size")) or 1
        return PageBudget("pixels", pixels) if pixels else None
    if _positive(proc.get("max_soft_tokens")):
        side = (_positive(proc.get("patch_size")) or 0) * (_positive(proc.get("pooling_kernel_size")) or 0)
        return PageBudget("pixels", proc["max_soft_tokens"] * side * side) if side else None
    tile = (_positive(size.get("height")) or 0) * (_positive(size.get("width")) or 0)
    if tile and _positive(proc.get("max_patches")):
        return PageBudget("pixels", proc["max_patches"] * tile)
    pinpoints = proc.get("image_grid_pinpoints")
    if isinstance(pinpoints, list) and pinpoints:
        areas = [(_positive(p[0]) or 0) * (_positive(p[1]) or 0) for p in pinpoints if isinstance(p, list) and len(p) == 2]
        return PageBudget("pixels", max(areas)) if areas and max(areas) else None
    if _positive(size.get("longest_edge")):
        return PageBudget("longest_edge", size["longest_edge"])
    if tile:
        return PageBudget("pixels", tile)
    if _positive(size.get("shortest_edge")):
        return PageBudget("shortest_edge", size["shortest_edge"])
    return None


def model_page_budget(model_dir: str | os.PathLike) -> PageBudget | None:
    """page_budget of the checkpoint in `model_dir`; None for one without image processor settings."""
    from mserve.common.checkpoint_files import CheckpointError, read_image_processor_config

    try:
        return page_budget(read_image_processor_config(model_dir)[0])
    except CheckpointError:
        return None


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


def page_scale(width_pt: float, height_pt: float, limits: DocumentLimits) -> float:
    """Pixels per point for a page of that box: the budget's, at least MIN_DOCUMENT_DPI/72 (else `dpi`/72, as
    set), less where the longer side would pass MAX_PAGE_SIDE_PX."""
    budget = limits.budget
    if budget is None:
        scale = limits.dpi / 72.0
    elif budget.kind == "pixels":
        scale = max((budget.value / (width_pt * height_pt)) ** 0.5, MIN_DOCUMENT_DPI / 72.0)
    else:
        side = max(width_pt, height_pt) if budget.kind == "longest_edge" else min(width_pt, height_pt)
        scale = max(budget.value / side, MIN_DOCUMENT_DPI / 72.0)
    return min(scale, MAX_PAGE_SIDE_PX / max(width_pt, height_pt))


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
            return [_render_page(pdf, i, page_scale(w, h, limits), field) for i, (w, h) in enumerate(boxes)]
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
