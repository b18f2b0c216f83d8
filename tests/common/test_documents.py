"""PDFs as pages (common/documents.py): order, determinism, and every refusal before a page renders."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mserve.common.documents import (MAX_PAGE_POINTS, DocumentError, DocumentLimits, PageBudget, model_page_budget,
                                     render_pdf)
from mserve.common.images import image_hash
from tests.helpers import make_pdf

pytest.importorskip("pypdfium2")


def hand_pdf(page_box: str = "0 0 90 60", count: int = 1, encrypt: bool = False) -> bytes:
    """A PDF written object by object (right xref offsets): `count` pages sharing one page object's box, and an
    /Encrypt dictionary (standard handler, RC4 40-bit, made-up keys) when `encrypt`."""
    kids = " ".join("3 0 R" for _ in range(count))
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {count} >>",
            f"<< /Type /Page /Parent 2 0 R /MediaBox [{page_box}] >>"]
    if encrypt:
        objs.append("<< /Filter /Standard /V 1 /R 2 /O <" + "11" * 32 + "> /U <" + "22" * 32 + "> /P -4 >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    extra = " /Encrypt 4 0 R /ID [<" + "ab" * 16 + "> <" + "ab" * 16 + ">]" if encrypt else ""
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R{extra} >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def test_pages_render_in_order_at_the_dpi_and_the_same_bytes_every_time():
    pdf = make_pdf([(90, 60), (60, 90), (45, 45)], seed=4)
    pages = render_pdf(pdf)
    assert [Image.open(io.BytesIO(p)).size for p in pages] == [(120, 80), (80, 120), (60, 60)]  # 96 DPI
    assert all(p.startswith(b"\x89PNG") for p in pages) and len({image_hash(p) for p in pages}) == 3
    assert render_pdf(make_pdf([(90, 60), (60, 90), (45, 45)], seed=4)) == pages  # the cache keys repeat
    # a page keeps its bytes in another document: the same page, first of one document and last of another
    assert render_pdf(make_pdf([(45, 45)], seed=6))[0] == pages[2]
    assert [Image.open(io.BytesIO(p)).size for p in render_pdf(pdf, DocumentLimits(dpi=72))][0] == (90, 60)
    # the colours survive: page 1's first pixel is make_image's (noise included) within rendering error
    want = Image.open(io.BytesIO(render_pdf(pdf, DocumentLimits(dpi=72))[0])).getpixel((40, 30))
    got = Image.open(io.BytesIO(pages[0])).getpixel((53, 40))
    assert max(abs(a - b) for a, b in zip(want, got)) < 80


def test_a_huge_page_is_scaled_to_the_side_cap_and_a_hand_written_pdf_renders():
    pages = render_pdf(hand_pdf("0 0 14400 720"))
    assert Image.open(io.BytesIO(pages[0])).size == (2048, 103)  # 102.4, rounded up by pypdfium2


@pytest.mark.parametrize("data, match", [
    (b"hello, not a pdf", "not a PDF"),
    (b"", "not a PDF"),
    (b"%PDF-1.4\n" + b"\x00" * 200, "cannot be read"),
    (hand_pdf(encrypt=True), "encrypted"),
    (hand_pdf(count=9), "9 pages, over the limit max_document_pages=8"),
    (hand_pdf(count=100_000), "100000 pages, over the limit max_document_pages=8"),  # a bomb: one page, 1e5 times
    (hand_pdf("0 0 1000000 1000000"), f"page 1 is 1e\\+06 x 1e\\+06 points.*max_page_points={MAX_PAGE_POINTS}"),
    (hand_pdf("0 0 0.5 300"), "page 1 is 0.5 x 300 points; each side must be within 1..14400"),
], ids=["junk", "empty", "corrupt", "encrypted", "pages", "page-bomb", "huge-box", "thin-box"])
def test_bad_documents_are_refused_naming_the_field_and_the_limit(data, match):
    with pytest.raises(DocumentError, match=match) as info:
        render_pdf(data, field="messages[0].content[1].file.file_data")
    assert str(info.value).startswith("messages[0].content[1].file.file_data: ")


def test_truncated_documents_and_the_byte_limit():
    pdf = make_pdf([(30, 20), (20, 30)])
    for cut in (len(pdf) // 3, len(pdf) // 2, len(pdf) - 40):
        with pytest.raises(DocumentError, match="cannot be read"):
            render_pdf(pdf[:cut])
    with pytest.raises(DocumentError, match=f"{len(pdf)} bytes, over the limit max_document_bytes=1000"):
        render_pdf(pdf, DocumentLimits(max_bytes=1000))
    assert len(render_pdf(pdf, DocumentLimits(max_pages=2))) == 2
    with pytest.raises(DocumentError, match="2 pages, over the limit max_document_pages=1"):
        render_pdf(pdf, DocumentLimits(max_pages=1))
    with pytest.raises(ValueError, match="max_pages must be a positive integer"):
        DocumentLimits(max_pages=0)


def test_files_on_disk(tmp_path):
    from mserve.common.documents import render_pdf_file

    pdf = make_pdf([(30, 20)])
    (tmp_path / "a.pdf").write_bytes(pdf)
    assert render_pdf_file(tmp_path / "a.pdf") == render_pdf(pdf)
    with pytest.raises(DocumentError, match=f"{len(pdf)} bytes, over the limit max_document_bytes=100"):
        render_pdf_file(tmp_path / "a.pdf", DocumentLimits(max_bytes=100))
    with pytest.raises(DocumentError, match="^doc: no such file$"):
        render_pdf_file(tmp_path / "b.pdf", field="doc")


@pytest.mark.parametrize("arch, budget", [
    ("qwen2_vl", PageBudget("pixels", 50176)),  # max_pixels (size.longest_edge)
    ("glm4v", PageBudget("pixels", 50176)),  # its max_pixels over temporal_patch_size (an image is 2 frames)
    ("gemma4", PageBudget("pixels", 70 * 8 * 8)),  # max_soft_tokens x (patch x pooling)^2
    ("internvl", PageBudget("pixels", 6 * 56 * 56)),  # max_patches x tile
    ("llama4", PageBudget("pixels", 4 * 56 * 56)),
    ("llava_next", PageBudget("pixels", 112 * 112)),  # the largest any-res canvas
    ("mistral3", PageBudget("longest_edge", 168)),
    ("idefics3", PageBudget("longest_edge", 168)),
    ("gemma3", PageBudget("pixels", 112 * 112)),  # fixed height x width
    ("llava", PageBudget("shortest_edge", 112)),  # CLIP: shortest edge, then a centre crop
])
def test_the_page_budget_is_the_pixels_each_processor_kind_keeps(arch, budget, tiny_model_dirs):
    assert model_page_budget(tiny_model_dirs[arch]) == budget
    assert model_page_budget(tiny_model_dirs[arch].parent) is None  # no image processor settings: the DPI default


def test_a_budget_sizes_the_page_within_the_legibility_floor_and_the_side_cap():
    def size(box, budget):
        return Image.open(io.BytesIO(render_pdf(make_pdf([box], seed=4), DocumentLimits(budget=budget))[0])).size

    assert size((300, 150), PageBudget("pixels", 1200 * 600)) == (1200, 600)  # the area, aspect kept
    assert size((300, 150), PageBudget("longest_edge", 900)) == (900, 450)
    assert size((300, 150), PageBudget("shortest_edge", 450)) == (900, 450)
    assert size((300, 150), PageBudget("pixels", 100)) == (300, 150)  # MIN_DOCUMENT_DPI: one pixel per point
    assert size((300, 150), PageBudget("longest_edge", 10 ** 6)) == (2048, 1024)  # MAX_PAGE_SIDE_PX
    assert render_pdf(make_pdf([(300, 150)], seed=4), DocumentLimits(budget=PageBudget("pixels", 1200 * 600))) == \
        render_pdf(make_pdf([(300, 150)], seed=4), DocumentLimits(budget=PageBudget("pixels", 1200 * 600)))
