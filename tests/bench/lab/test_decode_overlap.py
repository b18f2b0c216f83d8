"""lab.decode_overlap runs both ways (encode batches, unified admission) on a tiny model."""

from __future__ import annotations

import json

from lab.decode_overlap import main


def test_decode_overlap_reports_both_modes(tiny_model_dirs, capsys):
    model = str(tiny_model_dirs["llava"])
    assert main(["--model", model, "--batches", "2", "--batch", "2", "--size", "64x48", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["images"] == 4 and out["sequential_s"] > 0 and out["overlapped_s"] > 0
    assert main(["--model", model, "--unified", "--batch", "2", "--size", "64x48", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == 2 and out["admission_ms_decoding_on_loop"] > 0
