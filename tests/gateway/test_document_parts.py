"""A PDF as OpenAI's `file` part (gateway) and as a `document` part (Python client): its pages become image
parts in order, and every bad document is a 400 naming the field and the limit."""

from __future__ import annotations

import asyncio
import base64

import pytest

from mserve.common.documents import DocumentLimits, model_page_budget, render_pdf
from mserve.coordinator.client_core import generate_body, normalize_client_messages
from mserve.gateway.app import Gateway
from mserve.gateway.models import ModelCatalog
from mserve.gateway.openai_api import ApiError, has_documents, parse_chat_request
from mserve.gateway.settings import GatewaySettings
from tests.helpers import make_pdf

pytest.importorskip("pypdfium2")
PDF = make_pdf([(48, 36), (36, 48)], seed=2)
PAGES = render_pdf(PDF)
WHERE = "messages[0].content[1].file"


def file_part(data: bytes = PDF, mime: str = "application/pdf", **extra) -> dict:
    return {"type": "file", "file": {"filename": "a.pdf",
                                     "file_data": f"data:{mime};base64," + base64.b64encode(data).decode(), **extra}}


def chat(*parts, **kw):
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Read this."}, *parts]}]}, **kw)


def test_a_file_part_becomes_its_pages_in_order_beside_the_other_parts():
    req = chat(file_part(), {"type": "text", "text": "Summarize."})
    assert req.messages[0]["content"] == [{"type": "text", "text": "Read this."},
                                          {"type": "image", "image": PAGES[0]}, {"type": "image", "image": PAGES[1]},
                                          {"type": "text", "text": "Summarize."}]
    body = {"messages": [{"role": "user", "content": [file_part()]}]}
    assert has_documents(body) and not has_documents({"messages": [{"role": "user", "content": "hi"}]})
    assert not has_documents([1]) and not has_documents({"messages": [{"content": [3]}]})


def error(*parts, **kw) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(*parts, **kw)
    assert info.value.status == 400 and info.value.message
    return info.value


@pytest.mark.parametrize("part, param, match", [
    ({"type": "file"}, f"{WHERE}", "must be an object with file_data"),
    ({"type": "file", "file": {"file_id": "file-abc"}}, f"{WHERE}.file_id", "uploaded files are not supported"),
    ({"type": "file", "file": {"file_data": PDF.hex()}}, f"{WHERE}.file_data", "must be a base64 data URL"),
    ({"type": "file", "file": {"file_data": "data:application/pdf,abc"}}, f"{WHERE}.file_data", "must be base64"),
    (file_part(mime="text/plain"), f"{WHERE}.file_data", "'text/plain' are not supported"),
    ({"type": "file", "file": {"file_data": "data:application/pdf;base64,%%%"}}, f"{WHERE}.file_data",
     "not valid base64"),
    (file_part(b"not a pdf at all"), f"{WHERE}.file_data", "not a PDF"),
    (file_part(PDF[: len(PDF) // 2]), f"{WHERE}.file_data", "cannot be read"),
], ids=["no-file", "file_id", "not-a-url", "not-base64", "mime", "bad-base64", "not-pdf", "truncated"])
def test_bad_file_parts_name_the_field(part, param, match):
    exc = error(part)
    assert exc.param == param and match in exc.message, exc.message


def test_the_gateway_limits_name_themselves():
    exc = error(file_part(), documents=DocumentLimits(max_pages=1))
    assert exc.param == f"{WHERE}.file_data" and "2 pages, over the limit max_document_pages=1" in exc.message
    exc = error(file_part(), documents=DocumentLimits(max_bytes=100))
    assert "over the limit max_document_bytes=100" in exc.message  # refused before the base64 is decoded


def test_the_python_client_renders_document_parts_as_the_gateway_does(tmp_path):
    path = tmp_path / "a.pdf"
    path.write_bytes(PDF)
    for value in (PDF, str(path), path):
        out = normalize_client_messages([{"role": "user", "content": [{"type": "document", "document": value},
                                                                       {"type": "text", "text": "hi"}]}])
        assert out[0]["content"] == [{"type": "image", "image": PAGES[0]}, {"type": "image", "image": PAGES[1]},
                                     {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].document: not a PDF"):
        normalize_client_messages([{"role": "user", "content": [{"type": "document", "document": b"junk"}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].document: no such file"):
        normalize_client_messages([{"role": "user", "content": [{"type": "document", "document": "/nope.pdf"}]}])
    doc = [{"role": "user", "content": [{"type": "document", "document": PDF}]}]
    with pytest.raises(ValueError, match="2 pages, over the limit max_document_pages=1"):
        generate_body("r", doc, False, max_document_pages=1)  # client.generate(..., max_document_pages=1)
    assert len(generate_body("r", doc, False, max_document_pages=2)["messages"][0]["content"]) == 2


def test_the_gateway_renders_pages_at_the_requested_models_budget_unless_given_a_dpi(tiny_model_dirs):
    """Two served models, each its own processor's budget (common/documents.py); --document-dpi wins; a model
    whose folder is not here, or one not served, keeps the DPI default."""
    folders = {"q": str(tiny_model_dirs["qwen2_vl"]), "l": str(tiny_model_dirs["mistral3"]), "gone": "/nonexistent"}

    async def status() -> dict:  # the coordinator's STATUS, as the catalog reads it
        return {"model": "q", "served_models": list(folders), "models": {n: {"model_path": f} for n, f in folders.items()}}

    async def pages(settings: GatewaySettings, model: str) -> list[bytes]:
        gateway = Gateway(settings)
        gateway.catalog = ModelCatalog(status, None, None)
        await gateway.catalog.refresh()
        req = parse_chat_request({"model": model, "messages": [{"role": "user", "content": [file_part()]}]},
                                 documents=await gateway.document_limits(model))
        await gateway.close()
        return [part["image"] for part in req.messages[0]["content"]]

    for model, arch in (("q", "qwen2_vl"), ("l", "mistral3")):
        want = render_pdf(PDF, DocumentLimits(budget=model_page_budget(tiny_model_dirs[arch])))
        assert asyncio.run(pages(GatewaySettings(), model)) == want != PAGES
    assert asyncio.run(pages(GatewaySettings(document_dpi=96), "q")) == PAGES
    assert asyncio.run(pages(GatewaySettings(), "gone")) == asyncio.run(pages(GatewaySettings(), "unknown")) == PAGES
