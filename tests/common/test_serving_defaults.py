"""The defaults a server picks when the user names nothing (common/serving_defaults.py), and the rule
that says when a reduced-precision greedy sequence is HF's (common/exactness.py)."""

from __future__ import annotations

import json

import pytest

from mserve.common.exactness import compare_greedy, is_tie, ulp
from mserve.common.serving_defaults import checkpoint_dtype, cpu_native_bf16, default_layout, serving_dtype


@pytest.mark.parametrize("device, requested, checkpoint, native, want", [
    ("cpu", None, "float32", True, "bfloat16"),     # a float32 checkpoint is cast where bf16 is native
    ("cpu", None, "bfloat16", True, "bfloat16"),
    ("cpu", None, "float16", True, "bfloat16"),     # float16 has no fast CPU kernels
    ("cpu", "auto", "bfloat16", False, "float32"),  # emulated bf16 is slower than float32
    ("cpu", None, None, False, "float32"),
    ("cpu", "float32", "bfloat16", True, "float32"),  # a dtype the user names wins
    ("cuda", None, "float16", False, "float16"),
    ("cuda", None, "float32", False, "bfloat16"),
    ("cuda:1", None, None, False, "bfloat16"),
])
def test_serving_dtype(device, requested, checkpoint, native, want):
    assert serving_dtype(device, requested, checkpoint, native_bf16=native) == want


def test_serving_dtype_refuses_an_unknown_dtype_naming_the_choices():
    with pytest.raises(ValueError, match="dtype='fp8': one of auto, float32, bfloat16, float16"):
        serving_dtype("cpu", "fp8", None, native_bf16=True)


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    assert cpu_native_bf16(frozenset({"avx512f", "avx512_bf16"})) and cpu_native_bf16(frozenset({"amx_bf16"}))
    assert not cpu_native_bf16(frozenset({"avx2", "fma", "avx512f"}))
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_bf16\n")
    from mserve.common.serving_defaults import cpu_flags

    assert "avx512_bf16" in cpu_flags(str(info)) and cpu_flags(str(tmp_path / "none")) == frozenset()


def test_checkpoint_dtype_reads_the_config(tmp_path, tiny_model_dirs):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "bfloat16"}}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype(tiny_model_dirs["llava"]) == "float32"
    assert checkpoint_dtype(tmp_path / "missing") is None


@pytest.mark.parametrize("cores, gpus, want", [
    (1, 0, (1, 1)), (2, 0, (2, 1)), (8, 0, (8, 1)), (16, 0, (8, 2)), (0, 0, (1, 1)), (16, 4, (4, 1)),
])
def test_default_layout_is_unified_workers_for_the_host(cores, gpus, want):
    layout = default_layout(cores, gpus)
    assert (layout.encode, layout.prefill, layout.decode) == (0, 0, 0)
    assert (layout.unified, layout.threads) == want
    assert layout.describe().startswith(f"unified:{want[0]}, {want[1]} thread(s) each (")


def test_ulp_and_ties_in_bf16():
    assert ulp(1.0, "bfloat16") == 2 ** -7 and ulp(3.0, "bfloat16") == 2 ** -6 and ulp(1.0, "float32") == 0.0
    assert is_tie(10.0, 10.0 - 0.31, "bfloat16") and not is_tie(10.0, 10.0 - 0.33, "bfloat16")  # 2 x 1.6e-2 x 10 = 0.32
    assert is_tie(-1.0, -1.03, "bfloat16") and not is_tie(10.0, 9.95, "float16")
    assert not is_tie(1.0, 1.0, "float32")  # float32 excuses nothing


def test_compare_greedy_stops_at_a_tie_and_names_a_real_difference():
    top2 = [(5.0, 1.0), (2.0, 2.0), (3.0, 0.0)]
    assert compare_greedy([1, 2, 3], [1, 2, 3], None, "float32").exact
    tied = compare_greedy([1, 2, 3], [1, 9, 8], top2, "bfloat16")
    assert tied.exact and tied.compared == 2 and tied.tie_at == 1
    wrong = compare_greedy([1, 2, 3], [7, 2, 3], top2, "bfloat16")
    assert not wrong.exact and (wrong.first_difference, wrong.expected, wrong.produced) == (0, 1, 7)
    assert "token 0 differs: expected 1, produced 7" in wrong.describe()
    assert not compare_greedy([1, 2, 3], [1, 9, 3], top2, "float32").exact  # no ties in float32
    assert not compare_greedy([1, 2], [1, 2, 3], None, "float32").exact


def test_auto_never_picks_a_dtype_the_family_is_refused_in(tmp_path, tiny_model_dirs, monkeypatch):
    """A family whose reduced-precision tokens are unverified (FamilyRules.float32_only): auto gives it float32
    on any host; a dtype named is the user's (refused at load, naming why). No family is such today
    (Gemma 4's bf16 is HF's: tests/workers/test_engine_gemma4.py), so one is made up here."""
    from mserve.common import families
    from mserve.common.serving_defaults import serving_dtype_for

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "dtype": "bfloat16"}))
    assert serving_dtype_for("cuda", None, tmp_path) == "bfloat16"
    monkeypatch.setattr(families, "rules_for", lambda model_type: families.FamilyRules(float32_only="unverified"))
    assert serving_dtype_for("cuda", None, tmp_path) == "float32"
    assert serving_dtype_for("cuda", "bfloat16", tmp_path) == "bfloat16"
    monkeypatch.undo()
    assert serving_dtype_for("cuda", None, tiny_model_dirs["llava"]) == "bfloat16"
