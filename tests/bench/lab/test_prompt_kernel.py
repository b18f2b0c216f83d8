"""lab.prompt_kernel builds this checkout's prompt kernel beside a revision's and compares their bits."""

from __future__ import annotations

import re

from lab.prompt_kernel import CASES, main


def test_against_a_revision_reports_bits_and_times(capsys):
    assert main(["--against", "HEAD", "--rounds", "1", "--calls", "1"]) == 0
    out = capsys.readouterr().out
    if "no AVX512_BF16" in out:  # nothing to time on this CPU, and it says so
        return
    for name, *_ in CASES:  # HEAD's kernel source is this checkout's unless it is being edited
        assert re.search(rf"^{re.escape(name)}: this [\d.]+ ms, HEAD [\d.]+ ms; (the same bits|largest difference)",
                         out, re.M), out
