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
    # vdpbf16ps does twice an FMA's FLOP an instruction, but its rate is the host's: 2x the FMA's
    # GFLOP/s on the AMD EPYC hosts seen, half of it on an Intel Xeon with AMX (one issued every
    # other cycle). Only the range is everyone's.
    if "dpbf16" in rates:
        assert 1 <= int(rates["dpbf16"]) <= 4000, out
