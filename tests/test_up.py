"""`mserve up`'s several-models input: --model repeated and --models-file (JSON or YAML), read before anything starts."""

from __future__ import annotations

import json
import re

import pytest

from mserve.up import _main, read_models_file


def test_a_models_file_gives_role_counts_per_model_json_and_yaml(tmp_path):
    doc = {"models": [{"model": "m/llava", "decode": 2}, {"model": "m/qwen", "unified": 1}]}
    (tmp_path / "models.json").write_text(json.dumps(doc))
    (tmp_path / "models.yaml").write_text("models:\n  - model: m/llava\n    decode: 2\n  - model: m/qwen\n    unified: 1\n")
    want = [("m/llava", {"encode": 1, "prefill": 1, "decode": 2, "unified": 0}),
            ("m/qwen", {"encode": 0, "prefill": 0, "decode": 0, "unified": 1})]  # only unified: no stage pools
    assert read_models_file(str(tmp_path / "models.json")) == want
    assert read_models_file(str(tmp_path / "models.yaml")) == want


@pytest.mark.parametrize("doc, why", [
    ({"models": []}, "expected"), ({"models": [{"decode": 1}]}, 'models[0] needs "model"'),
    ({"models": [{"model": "m", "decoders": 2}]}, "unknown keys ['decoders']"),
    ({"models": [{"model": "m", "decode": -1}]}, "whole numbers >= 0"),
])
def test_a_bad_models_file_is_refused_naming_the_entry(tmp_path, doc, why):
    path = tmp_path / "models.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=re.escape(why)):
        read_models_file(str(path))


def test_mserve_up_refuses_a_model_named_twice_or_none_before_starting_anything(caplog):
    assert _main(["--model", "m/a", "--model", "m/a"]) == 1
    assert _main([]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["mserve up failed: a model is named twice: ['m/a', 'm/a']",
                      "mserve up failed: name a model (--model FOLDER, repeatable, or --models-file FILE)"]


@pytest.fixture
def launched_with(monkeypatch) -> dict:
    """What `mserve up` would give LocalCluster: its keyword arguments, recorded; the cluster is not started
    (run_up then fails with 1)."""
    import mserve.up as up

    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def start(self, timeout_s):
            raise RuntimeError("recorded, not started")

    monkeypatch.setattr(up, "LocalCluster", Recorder)
    return seen


def test_mserve_up_passes_dtype_and_attention_to_every_worker(tiny_model_dirs, launched_with):
    """`mserve up --dtype bfloat16 --attention padded`: the workers' flags (the coordinator takes neither)."""
    import mserve.up as up
    from mserve.cli import build_parser

    args = build_parser().parse_args(["up", "--model", str(tiny_model_dirs["llava"]), "--unified", "1",
                                      "--dtype", "bfloat16", "--attention", "padded"])
    assert up.run_up(args) == 1
    assert launched_with["extra_worker_args"] == ["--dtype", "bfloat16", "--attention", "padded"]
    assert launched_with["extra_coordinator_args"] == []


def test_mserve_up_passes_coordinator_and_worker_flags_through(tiny_model_dirs, launched_with):
    """`--coordinator-args` / `--worker-args`: any flag of `mserve coordinator` / `mserve worker`, after the
    launcher's own (so a routing setting such as --local-prefill-tokens needs no environment variable)."""
    import mserve.up as up
    from mserve.cli import build_parser

    args = build_parser().parse_args(["up", "--model", str(tiny_model_dirs["llava"]), "--dtype", "bfloat16",
                                      "--coordinator-args", "--local-prefill-tokens 1400 --kv-hand-back",
                                      "--worker-args=--max-num-seqs 8 --class-aging-s=2"])
    assert up.run_up(args) == 1
    assert launched_with["extra_coordinator_args"] == ["--local-prefill-tokens", "1400", "--kv-hand-back"]
    assert launched_with["extra_worker_args"] == ["--dtype", "bfloat16", "--max-num-seqs", "8", "--class-aging-s=2"]


@pytest.mark.parametrize("flags, why", [
    (["--coordinator-args", "--local-prefil-tokens 3"], "`mserve coordinator` has no --local-prefil-tokens"),
    (["--coordinator-args", "--local-prefill-tokens many"], "--local-prefill-tokens: invalid int value: 'many'"),
    (["--worker-args=--max-num-seqs"], "--max-num-seqs: expected one argument"),
    (["--worker-args", "--threads 4"], "--threads is set by mserve up itself"),
    (["--coordinator-args=--bind=tcp://127.0.0.1:1"], "--bind is set by mserve up itself"),
    (["--worker-args", "--class-aging-s '2"], "--worker-args: No closing quotation"),
])
def test_mserve_up_refuses_bad_passed_flags_before_starting_anything(flags, why, caplog, tiny_model_dirs, monkeypatch):
    import mserve.up as up

    monkeypatch.setattr(up, "LocalCluster", None)  # nothing may be started
    assert _main(["--model", str(tiny_model_dirs["llava"]), *flags]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("mserve up failed: --") and why in errors[0], errors


@pytest.mark.parametrize("flags, pools, threads", [
    ([], {"encode": 0, "prefill": 0, "decode": 0, "unified": 2}, 1),  # picked for the 2 cores given below
    (["--threads", "3"], {"encode": 0, "prefill": 0, "decode": 0, "unified": 2}, 3),
    (["--unified", "1"], {"encode": 0, "prefill": 0, "decode": 0, "unified": 1}, 1),
    (["--decode", "2"], {"encode": 1, "prefill": 1, "decode": 2, "unified": 0}, 1),
    (["--unified", "1", "--encode", "1"], {"encode": 1, "prefill": 1, "decode": 1, "unified": 1}, 1),
])
def test_mserve_up_picks_roles_for_the_host_only_when_none_are_named(flags, pools, threads, tiny_model_dirs,
                                                                    launched_with, monkeypatch, caplog):
    import mserve.common.cpu_placement as placement
    import mserve.up as up
    from mserve.cli import build_parser

    monkeypatch.setattr(placement, "usable_cores", lambda: (0, 1))
    args = build_parser().parse_args(["up", "--model", str(tiny_model_dirs["llava"]), *flags])
    with caplog.at_level("INFO", logger="mserve.coordinator.launcher"):
        assert up.run_up(args) == 1
    assert {r: launched_with[r] for r in pools} == pools and launched_with["threads"] == threads
    picked = [r.getMessage() for r in caplog.records if "no roles named" in r.getMessage()]
    assert bool(picked) == (not flags or flags[0] == "--threads")
    if picked:
        assert "unified:2" in picked[0] and "one unified worker per core on 2 core(s)" in picked[0]
