"""lab.decode_kernel builds the decode kernel, checks it against gather + SDPA and times it, for each
layout of the pool it offers, on 4 KiB pages and on huge pages."""

from __future__ import annotations

import re

import pytest

from lab.decode_kernel import main


@pytest.mark.parametrize("blocks,huge", [("scattered", "off"), ("descending", "on")])
def test_each_layout_agrees_with_sdpa_and_is_timed(capsys, blocks, huge):
    assert main(["--rounds", "1", "--batch", "2", "--blocks", blocks, "--huge-pages", huge]) == 0
    out = capsys.readouterr().out
    diffs = re.findall(r"^torch\.(\w+)\s+this\s+largest difference from gather \+ SDPA: ([\d.e+-]+)", out, re.M)
    assert {d for d, _ in diffs} == {"float32", "bfloat16"}, out
    assert all(float(x) < 1e-4 for _, x in diffs), out
    times = re.findall(r"^torch\.\w+\s+this\s+([\d.]+) ms a step \(8 layers\)", out, re.M)
    assert len(times) == 2 and all(float(t) > 0 for t in times), out
