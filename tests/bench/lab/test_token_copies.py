"""lab.token_copies: the row copies give the advanced-indexing copies' bits, for one group and a ragged one."""

from __future__ import annotations

import re

import pytest

from lab.token_copies import main


@pytest.mark.parametrize("chunks", ["40", "40,40", "40,23"])
def test_both_ways_copy_the_same_bits(capsys, chunks):
    assert main(["--decode", "5", "--chunks", chunks, "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "the same bits: True" in out, out
    assert re.search(r"round 1: advanced indexing \d+ us a layer, row copies \d+ us", out), out
