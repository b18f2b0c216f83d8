"""The GPU check (bench/lab/gpu/check.py, started by bench/gpu_check.py) as a CPU dry run at tiny sizes:
every part runs its real path and reports it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.gpu import check as gpu_check
from mserve.workers import kernels

LAUNCHER = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"

TINY = ["--device", "cpu", "--big", "tiny", "--requests", "3", "--new-tokens", "4", "--batches", "1,2",
        "--prompt-tokens", "16", "--bench-new-tokens", "4", "--serve-requests", "4", "--serve-rate", "50"]


def test_dry_run_checks_exactness_and_measures_the_stand_in(tmp_path, capsys):
    assert gpu_check.main([*TINY, "--parts", "exact,big", "--families", "llava", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    exact = report["exact"]["llava"]  # both families' bf16 exactness: tests/workers/test_engine_bf16.py
    assert exact["requests"] == exact["equal"] == 3 and not exact["mismatches"], exact
    assert exact["kv_dtype"] == "torch.bfloat16"
    big = report["big"]
    assert big["size"] == "tiny"
    assert set(big["engine"]) == set(big["engine_padded"]) == set(big["hf_generate"]) == {"1", "2"}
    assert all(v["tokens"] == int(b) * 4 for b, v in big["engine"].items())
    assert big["serving"]["requests"] == 4 and big["serving"]["image_requests"] == 2
    assert big["memory_after_serving"]["rss_mib"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| engine llava | 3/3 | none |" in table and "| 2 |" in table and table == gpu_check.render(report)
    assert table in capsys.readouterr().out


def test_dry_run_attention_part_profiles_exact_and_padded(tmp_path):
    assert gpu_check.main([*TINY, "--parts", "attention", "--families", "llava", "--profile-batches", "4",
                           "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    att = report["attention"]
    assert att["padded_tokens"]["llava"]["requests"] == 3
    exact, padded = att["profile"]
    assert (exact["attention"], padded["attention"], exact["batch"]) == ("exact", "padded", 4)
    # Exact: one SDPA call per distinct context length and layer (2 layers). Padded: none where the decode
    # kernel reads the bf16 pool in place (a CPU with a compiler), else one per layer.
    assert exact["sdpa_calls_per_step"] > 2
    assert padded["sdpa_calls_per_step"] == (0 if kernels.library() is not None else 2)
    assert exact["aten_calls_per_step"] > padded["aten_calls_per_step"] > 0 and exact["top_host_ops"]
    assert "| 4 | exact |" in (tmp_path / "gpu_check.md").read_text()


def test_unknown_part_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown part"):
        gpu_check.main(["--device", "cpu", "--parts", "exact,gpu", "--out", str(tmp_path)])


@pytest.mark.slow
def test_dry_run_cluster_part_matches_hf(tmp_path):
    assert gpu_check.main([*TINY, "--parts", "cluster", "--families", "llava", "--transfers", "torch",
                           "--out", str(tmp_path)]) == 0
    cluster = json.loads((tmp_path / "gpu_check.json").read_text())["cluster"]["llava-torch"]
    assert cluster.get("error") is None, cluster
    assert cluster["equal"] == cluster["requests"] == 3
    assert set(cluster["memory"]) == {"coordinator", "encode-0", "prefill-0", "decode-0"}


def test_launcher_runs_the_lab_check_from_outside_the_checkout(tmp_path):
    """bench/gpu_check.py, the path bench/gpu_check.md runs, reaches the lab's main from any folder."""
    done = subprocess.run([sys.executable, str(LAUNCHER), "--device", "cpu", "--parts", "exact,gpu",
                           "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown part(s) ['gpu']" in done.stderr, done.stderr[-2000:]
