"""lab.decode_kernel builds the decode kernel, checks it against gather + SDPA and times it (here over
a small pool whose blocks run counting down, on huge pages)."""

from __future__ import annotations

import re

from lab.decode_kernel import main


def test_runs_counting_down_on_huge_pages_agree_with_sdpa_and_are_timed(capsys):
    assert main(["--rounds", "1", "--batch", "2", "--pool-blocks", "256", "--blocks", "descending",
                 "--huge-pages", "on"]) == 0
    out = capsys.readouterr().out
    diffs = re.findall(r"^torch\.(\w+)\s+this\s+largest difference from gather \+ SDPA: ([\d.e+-]+)", out, re.M)
    assert {d for d, _ in diffs} == {"float32", "bfloat16"}, out
    assert all(float(x) < 1e-4 for _, x in diffs), out
    times = re.findall(r"^torch\.\w+\s+this\s+([\d.]+) ms a step \(8 layers\)", out, re.M)
    assert len(times) == 2 and all(float(t) > 0 for t in times), out
