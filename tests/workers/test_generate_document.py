"""`mserve generate --document PATH` (in process): the PDF's pages are the prompt's images, in order."""

from __future__ import annotations

import json

import pytest

from mserve.cli import main
from mserve.common.documents import DocumentLimits, model_page_budget, render_pdf
from mserve.common.prompt import PromptBuilder
from tests.helpers import make_pdf

pytest.importorskip("pypdfium2")


def test_a_document_is_its_pages_as_images(tiny_model_dirs, tmp_path, capsys):
    model = str(tiny_model_dirs["llava"])
    pdf = tmp_path / "a.pdf"
    pdf.write_bytes(make_pdf([(60, 45), (45, 60)], seed=7))
    pages = render_pdf(pdf.read_bytes(), DocumentLimits(budget=model_page_budget(model)))  # as the gateway does
    common = ["generate", "--model", model, "--prompt", "Summarize.", "--max-tokens", "6", "--dtype", "float32",
              "--json"]
    assert main([*common, "--document", str(pdf)]) == 0
    got = json.loads(capsys.readouterr().out)
    # the pages, in order, are the prompt's images (the gateway test checks the answer against the images sent)
    assert got["prompt_token_ids"] == PromptBuilder(model).prepare_text("Summarize.", pages).prompt_ids
    assert len(got["token_ids"]) == 6 and set(got) == {"prompt_token_ids", "token_ids", "text"}
    with pytest.raises(SystemExit, match=r"error: --document .*a.pdf: the document has 2 pages, over the limit "
                                         r"max_document_pages=1"):
        main([*common, "--document", str(pdf), "--max-document-pages", "1"])
    with pytest.raises(SystemExit, match="missing.pdf: no such file"):
        main([*common, "--document", str(tmp_path / "missing.pdf")])
