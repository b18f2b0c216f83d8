"""`mserve generate` as a user runs it: a real subprocess, checked against HF generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mserve.common.exactness import compare_greedy
from mserve.common.serving_defaults import serving_dtype_for
from tests.helpers import hf_generate_top2, make_image


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mserve.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("arch, flags", [("llava", []), ("qwen2_vl", ["--dtype", "float32"])],
                         ids=["llava-default", "qwen2_vl-float32"])
def test_generate_json_matches_hf(tiny_model_dirs, tmp_path, arch, flags):
    """With no flags, `mserve generate` runs the serving default (bfloat16 where this CPU has native bf16):
    HF generate's ids in that dtype, up to HF's first top-2 tie; `--dtype float32`: bit for bit."""
    model = str(tiny_model_dirs[arch])
    dtype = serving_dtype_for("cpu", flags[1] if flags else None, model)
    img = tmp_path / "cat.png"
    img.write_bytes(make_image(320, 240, seed=3))
    res = run_cli("generate", "--model", model, "--prompt", "What animal is this?", "--image", str(img),
                  "--max-tokens", "8", "--json", *flags)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text"}
    want, top2 = hf_generate_top2(model, out["prompt_token_ids"], [img.read_bytes()], 8, dtype=dtype)
    verdict = compare_greedy(want, out["token_ids"], top2, dtype)
    # float32 compares all 8; the default's bf16 stops at HF's first near-tie (the batch and cluster tests
    # count how much of their sequences that leaves): here, this CLI's dtype and tokens end to end.
    assert verdict.exact and verdict.compared >= (8 if dtype == "float32" else 1), verdict.describe()
    assert isinstance(out["text"], str)


def test_generate_errors_are_clear(tiny_model_dirs, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    model = str(tiny_model_dirs["llava"])
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    cases = [  # (arguments, what stderr must say); independent processes, run side by side
        (["--model", model, "--prompt", "hi", "--image", str(tmp_path / "missing.png")], "missing.png: no such file"),
        (["--model", model, "--prompt", "hi", "--image", str(bad)], "cannot read image header"),
        (["--model", model, "--prompt", ""], "prompt is empty"),
        (["--model", str(tmp_path), "--prompt", "hi"], "no config.json"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: run_cli("generate", *case[0]), cases))
    for (args, says), res in zip(cases, results):
        assert res.returncode != 0 and says in res.stderr, (args, res.stderr[-2000:])
