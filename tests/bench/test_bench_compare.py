"""`mserve bench compare`: configuration parsing, and a tiny real run of two launched configurations."""

from __future__ import annotations

import json

import pytest

from mserve.bench.compare import ConfigSpec, parse_config, parse_configs
from mserve.cli import main as cli_main


def test_a_configuration_sets_its_cpu_placement_and_flags_both_sides_take() -> None:
    spec = parse_config("disagg:1e1p1d@cpu-placement=off@class-aging-s=2@attention=padded")
    assert spec.cpu_placement == "off"
    assert spec.coordinator_args == ("--class-aging-s", "2")  # the coordinator's queues and...
    assert spec.worker_args == ("--class-aging-s", "2", "--attention", "padded")  # ...each worker's
    assert parse_config("unified:2").cpu_placement is None  # --cpu-placement decides
    with pytest.raises(ValueError, match="auto or off"):
        parse_config("unified:2@cpu-placement=yes")
    with pytest.raises(ValueError, match="cpu-placement applies to"):
        parse_config("openai:http://127.0.0.1:8000/v1@cpu-placement=off")


def test_parse_configs() -> None:
    specs = parse_configs("disagg:1e1p1d, unified:2,hf-sequential,openai:http://127.0.0.1:8000/v1,zmq://127.0.0.1:5555")
    assert specs == [
        ConfigSpec("disagg:1e1p1d", "cluster", {"encode": 1, "prefill": 1, "decode": 1, "unified": 0}),
        ConfigSpec("unified:2", "cluster", {"encode": 0, "prefill": 0, "decode": 0, "unified": 2}),
        ConfigSpec("hf-sequential", "hf"),
        ConfigSpec("openai:http://127.0.0.1:8000/v1", "http", url="http://127.0.0.1:8000/v1"),
        ConfigSpec("zmq://127.0.0.1:5555", "zmq", url="zmq://127.0.0.1:5555"),
    ]
    assert parse_config("disagg:2e3p4d").pools == {"encode": 2, "prefill": 3, "decode": 4, "unified": 0}
    assert parse_config("disagg").pools == {"encode": 1, "prefill": 1, "decode": 1, "unified": 0}
    assert parse_config("unified").pools["unified"] == 1


@pytest.mark.parametrize("bad", ["disagg:1e1p", "disagg:0e1p1d", "unified:0", "unified:x", "openai:ftp://x",
                                 "vllm", "", "unified:1,unified:1"])
def test_parse_configs_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_configs(bad)


@pytest.mark.slow
def test_compare_runs_each_configuration(tiny_model_dirs, redis_url, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)  # the launched cluster uses the test's redis
    out = tmp_path / "cmp"
    rc = cli_main(["bench", "compare", "--model", str(tiny_model_dirs["llava"]), "--configs", "unified:1,hf-sequential",
                   "--trace", "mixed", "--num-requests", "6", "--max-tokens", "4", "--ignore-eos",
                   "--resolutions", "64x64", "--slo", "ttft=60000", "--warmup", "1", "--no-progress", "--no-plots",
                   "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    md = (out / "compare.md").read_text()
    assert "| metric | unified:1 | hf-sequential (vs unified:1) |" in printed and printed.strip() in md
    for label in ("text-only TTFT p99 ms", "image TTFT p50 ms", "goodput req/s", "req/s"):
        assert f"| {label} |" in md
    # the coordinator's own counts over the trace; HF's server has none
    assert "| stage re-runs | 0 | — |" in md and "| prompts lent to decode | 0 | — |" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["configs"] == ["unified:1", "hf-sequential"] and not data["failures"]
    for sub in ("0-unified_1", "1-hf-sequential"):
        res = json.loads((out / sub / "results.json").read_text())
        assert res["summary"]["overall"]["completed"] == 6
        assert all(r["output_tokens"] == 4 for r in res["records"])  # ignore_eos reached both systems
    assert (out / "1-hf-sequential" / "logs" / "hf_server.log").is_file()


def test_cluster_configs_take_worker_settings_for_side_by_side_runs():
    from mserve.bench.compare import parse_config

    spec = parse_config("unified:2@max-prefill-tokens=256@max-num-seqs=8")
    assert spec.label == "unified:2@max-prefill-tokens=256@max-num-seqs=8" and spec.pools["unified"] == 2
    assert spec.worker_args == ("--max-prefill-tokens", "256", "--max-num-seqs", "8")
    assert parse_config("disagg:1e1p1d").worker_args == ()
    mixed = parse_config("disagg:1e1p1d@max-stages-per-worker=2@max-num-seqs=8")  # coordinator's, then workers'
    assert mixed.coordinator_args == ("--max-stages-per-worker", "2") and mixed.worker_args == ("--max-num-seqs", "8")
    for bad in ("unified:1@max-prefill-tokens", "unified:1@Bad=1", "hf-sequential@max-num-seqs=2"):
        with pytest.raises(ValueError, match="@"):
            parse_config(bad)


def test_multiturn_groups_split_turns_and_count_encodes_per_conversation():
    from mserve.bench.compare import multiturn_groups
    from mserve.bench.serve import record_class

    rec = record_class()

    def r(conv: str, turn: int, ttft: float, hits: int) -> object:
        x = rec(request_id=f"{conv}{turn}", modality="image", conversation_id=conv, turn=turn, start_s=0.0,
                first_token_s=ttft, end_s=ttft + 1, token_times_s=[ttft, ttft + 1], output_tokens=2)
        x.cache_hits = {"encoder": (hits, 1)}
        return x

    records = [r("a", 0, 1.0, 0), r("a", 1, 0.2, 1), r("a", 2, 0.2, 1), r("b", 0, 1.0, 0), r("b", 1, 0.6, 0)]
    groups = multiturn_groups(records, duration=10.0, slos={})
    assert groups["first_turn"]["count"] == 2 and groups["later_turns"]["count"] == 3
    assert groups["first_turn"]["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert groups["encodes_per_conversation"] == pytest.approx(1.5)  # a: 1, b: 2 (its turn 2 missed)
