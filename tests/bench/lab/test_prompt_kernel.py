"""lab.prompt_kernel builds this checkout's prompt kernel beside a revision's (and, on AMX hosts, with its
tiles off) and gather + SDPA, and compares their outputs."""

from __future__ import annotations

import re

from lab.prompt_kernel import CASES, main


def test_against_a_revision_reports_bits_and_times(capsys):
    assert main(["--against", "HEAD", "--rounds", "1", "--calls", "1", "--sdpa"]) == 0
    out = capsys.readouterr().out
    if "no AVX512_BF16" in out:  # nothing to time on this CPU, and it says so
        return
    for name, *_ in CASES:  # HEAD's kernel source is this checkout's unless it is being edited
        line = re.search(rf"^{re.escape(name)}: this(, AMX)? [\d.]+ ms, .*HEAD [\d.]+ ms, gather \+ SDPA [\d.]+ ms;.*",
                         out, re.M)
        assert line, out
        # HEAD beside this build's same products: both on tiles where HEAD has them (HEAD vs this, AMX),
        # the vdpbf16ps ones where only this build has tiles, or both without
        assert re.search(r"HEAD vs this(, vdpbf16ps|, AMX)?: (the same bits|largest difference)", line[0]), line[0]
        assert re.search(r"gather \+ SDPA vs this(, AMX)?: (the same bits|largest difference)", line[0]), line[0]
