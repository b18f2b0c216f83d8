"""lab.decode_linears times a decode step's linear layers four ways and checks the merged layers' bits."""

from __future__ import annotations

import re

from lab.decode_linears import main


def test_four_ways_timed_and_merged_bits_checked(capsys):
    assert main(["--layers", "2", "--rows", "4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    if "nothing to time" in out:  # a CPU whose oneDNN cannot prepack bf16
        return
    assert "2 layers x 7 linear layers at 4 rows" in out and "with the same bits" in out, out
    for way in ("after a flush", "back to back", "one layer x 2", "merged"):
        assert re.search(rf"^  {way}: [\d.]+ ms, \d+ GFLOP/s", out, re.M), out
