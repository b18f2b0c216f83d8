"""lab.encode_batch times the worker's own encode path at each batch size and reports every round."""

from __future__ import annotations

import json

from lab.encode_batch import main


def test_encode_batch_reports_each_size(tiny_model_dirs, capsys):
    assert main(["--model", str(tiny_model_dirs["llava"]), "--batches", "1,2", "--images", "2", "--size", "64x48",
                 "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["ms_per_image"]) == {"1", "2"} and all(len(r) == 2 for r in out["rounds"].values())
    assert all(ms > 0 for ms in out["ms_per_image"].values())
