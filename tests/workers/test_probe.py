"""The load-time probe refuses an engine that breaks a trait (mutations of the engine's own handling,
monkeypatched, the model untouched), and its verdict is cached per checkpoint content, dtype and version."""

from __future__ import annotations

import json
import time

import torch

from mserve.common.serving_defaults import serving_dtype_for
from mserve.workers import paged_attention, probe, verdicts
from mserve.workers.model_runner import ModelRunner


def test_sliding_window_ignored_is_refused_naming_the_case(tiny_model_dirs, monkeypatch):
    """llava_next_video's text layers all slide over 24 keys, shorter than every probe prompt."""
    attend = paged_attention._attend
    monkeypatch.setattr(paged_attention, "_attend",
                        lambda group, q, k, v, scaling, window=None, chunk=None: attend(group, q, k, v, scaling, None, chunk))
    verdict = probe.verify(str(tiny_model_dirs["llava_next_video"]), dtype="float32")
    assert not verdict.served
    assert verdict.reason.startswith("case 'text only': token 0 differs from Hugging Face generate (expected ")


def test_rope_index_replaced_by_1d_positions_is_refused_naming_an_image_case(tiny_model_dirs, monkeypatch):
    """Qwen2-VL's M-RoPE: 1-D positions on all three rows equal its index on text, not on an image's rows."""
    def one_d(self, prompt_ids, grids, fps=()):
        return torch.arange(len(prompt_ids)).expand(3, -1), 0

    monkeypatch.setattr(ModelRunner, "mrope_positions", one_d)
    verdict = probe.verify(str(tiny_model_dirs["qwen2_vl"]), dtype="float32")
    assert not verdict.served
    assert verdict.cases[0].ok  # text only: 1-D positions are M-RoPE's own there
    assert verdict.reason.startswith("case 'one image (small)': token ") and "expected" in verdict.reason


def test_bidirectional_image_attention_dropped_is_refused_naming_an_image_case(tiny_model_dirs, monkeypatch):
    """Gemma 3's image tokens attend to each other both ways (its own token_type_ids mask): made causal only."""
    from mserve.common.model import ModelFamily

    monkeypatch.setattr(ModelFamily, "bidirectional_images", property(lambda self: False))
    verdict = probe.verify(str(tiny_model_dirs["gemma3"]), dtype="float32")
    assert not verdict.served
    assert verdict.cases[0].ok  # text only: no image, nothing to attend both ways
    assert verdict.reason.startswith("case 'one image (small)': token ") and "expected" in verdict.reason


def test_admission_count_off_by_one_is_refused_naming_the_prompt(tiny_model_dirs, monkeypatch):
    """The probe proves admission too: a visual-token count that differs from the processor's refuses."""
    from mserve.common.model import ModelFamily

    count = ModelFamily.visual_token_count
    monkeypatch.setattr(ModelFamily, "visual_token_count", lambda self, size, keep_ratio=None: count(self, size) + 1)
    verdict = probe.verify(str(tiny_model_dirs["vipllava"]), dtype="float32")
    assert not verdict.served
    assert verdict.reason.startswith("case 'one image (small)': ") and "differs from the processor's own ids" in verdict.reason


def test_bf16_compare_stops_after_a_tie():
    clear, tie = (5.0, 1.0), (2.0, 2.0)
    assert probe.compare([1, 2, 3], [1, 2, 3], [clear] * 3, "bfloat16") == (None, 3)
    assert probe.compare([1, 2, 3], [1, 5, 3], [clear] * 3, "bfloat16") == (1, 2)
    assert probe.compare([1, 2, 3], [1, 5, 9], [clear, tie, clear], "bfloat16") == (None, 2)  # a tie at 1: rest not compared
    assert probe.compare([1, 2, 3], [1, 5, 9], [clear, tie, clear], "float32") == (1, 2)  # float32 excuses nothing
    assert probe.compare([1, 2], [1], [clear, clear], "float32") == (1, 2)


def test_verdict_is_cached_and_a_restart_reads_it(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("MSERVE_CACHE_DIR", str(tmp_path))
    model = tiny_model_dirs["deepseek_vl"]
    start = time.perf_counter()
    first, cached = verdicts.cached_verdict(model)
    probe_s = time.perf_counter() - start
    assert first["served"] and not cached
    start = time.perf_counter()
    again, cached = verdicts.cached_verdict(model)
    restart_s = time.perf_counter() - start
    assert cached and again == first
    assert verdicts.require_verified(model)["served"]
    files = list((tmp_path / "verdicts").glob("*.json"))
    dtype = serving_dtype_for("cpu", None, model)  # the serving default's: bfloat16 on native-bf16 CPUs
    assert [f.name for f in files] == [f"{verdicts.checkpoint_hash(model)}-{dtype}-{verdicts.mserve_version()}.json"]
    print(f"\nprobe of a tiny checkpoint: {probe_s:.2f} s; cached verdict on restart: {restart_s * 1000:.1f} ms")


def test_tested_family_skips_the_probe(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("MSERVE_CACHE_DIR", str(tmp_path))
    assert verdicts.require_verified(tiny_model_dirs["llava"]) is None
    assert not (tmp_path / "verdicts").exists()


def test_mserve_verify_prints_cases_traits_and_verdict(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """In process (the worker test in test_probe_families.py runs the CLI as a process)."""
    from mserve.cli import main

    monkeypatch.setenv("MSERVE_CACHE_DIR", str(tmp_path))
    assert main(["verify", "--model", str(tiny_model_dirs["llava_next_video"]), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["served"] and verdict["traits"]["layer_types"] == {"sliding_attention": 2}
    assert [c["ok"] for c in verdict["cases"]] == [True] * len(probe.CASES)
    assert main(["verify", "--model", str(tiny_model_dirs["qwen4_exp"])]) == 1
    assert ("REFUSED: model_type 'qwen4_exp': linear attention layers (Gated DeltaNet): not supported outside the "
            "tested Qwen3.5 families") in capsys.readouterr().out
