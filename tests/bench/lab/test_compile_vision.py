"""lab.compile_vision times the eager vision forward beside a compiled one and says how far apart they are."""

from __future__ import annotations

import re

import pytest

from lab.compile_vision import main


def test_eager_beside_compiled(tiny_model_dirs, capsys):
    assert main(["--model", str(tiny_model_dirs["llava"]), "--variants", "eager,compiled", "--rounds", "2",
                 "--calls", "1", "--size", "64x48"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"compiled: first call \d+\.\d s", out), out
    assert re.search(r"compiled: largest difference from eager \S+", out), out
    for variant in ("eager", "compiled"):
        assert re.search(rf"{variant}: median \d+\.\d+ ms an image \(rounds: [\d.]+, [\d.]+\)", out), out


def test_unknown_variant_is_named(tiny_model_dirs, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tiny_model_dirs["llava"]), "--variants", "eager,jit"])
    assert exc.value.code == 2
    assert "unknown variant(s) jit" in capsys.readouterr().err
