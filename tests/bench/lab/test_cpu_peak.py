"""lab.cpu_peak times real AVX-512 loops where the host has them, and says so where it does not."""

from __future__ import annotations

import re

from lab.cpu_peak import main


def test_peak_lines_are_plausible(capsys):
    assert main(["--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    if out.startswith("no AVX-512 build"):
        return
    rates = dict(re.findall(r"^(\w+)\s+[\d.]+ G instructions/s,\s+(\d+) GFLOP/s", out, re.M))
    assert "fma" in rates, out
    assert 1 <= int(rates["fma"]) <= 2000, out  # one core: a few to a few hundred GFLOP/s
    if "dpbf16" in rates:  # two bf16 products a lane: twice the FLOP of an FMA an instruction
        assert int(rates["dpbf16"]) > int(rates["fma"]), out
