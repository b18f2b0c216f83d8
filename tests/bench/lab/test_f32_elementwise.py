"""lab.f32_elementwise times the candidate float32 kernels beside HF's ops and checks they agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lab.f32_elementwise import main


@pytest.mark.skipif("avx2" not in Path("/proc/cpuinfo").read_text(), reason="the kernels need AVX2")
def test_kernels_timed_beside_hf_and_within_float32_ulps(tiny_model_dirs, capsys):
    assert main(["--model", str(tiny_model_dirs["llava"]), "--rows", "3,40", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) rows: RMSNorm .* us \(largest difference ([\d.e+-]+) relative\); "
                      r"a step saves -?[\d.]+ ms$", out, re.M)
    assert [r for r, _ in rows] == ["3", "40"], out
    assert all(float(diff) < 1e-5 for _, diff in rows), out
