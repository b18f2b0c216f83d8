"""`mserve bench compare --rounds N`: the rounds' order, seeds and medians (bench/rounds.py), and a real run
of two rounds against one cluster kept up between them."""

from __future__ import annotations

import json

import pytest

from mserve.bench.compare import slug
from mserve.bench.rounds import median_summary, round_order, round_ratio_table, round_ratios, round_seed
from mserve.cli import main as cli_main
from tests.clusters import LLAVA_UNIFIED


def test_each_round_starts_at_the_next_configuration_with_its_own_seed():
    assert [round_order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert round_order(1, 5) == [0] and round_order(0, 1) == []
    assert [round_seed(7, r) for r in range(3)] == [7, 8, 9]  # round 0 keeps --seed: one round is a plain run


def test_the_median_summary_takes_each_number_over_the_rounds_that_have_it():
    rounds = [{"request_throughput": 1.0, "ttft_ms": {"p99": 300.0, "p50": 10}, "errors": {"timeout": 1},
               "slos_ms": None, "image": {}, "goodput": None},
              {},  # a round this configuration failed: left out
              {"request_throughput": 3.0, "ttft_ms": {"p99": 100.0, "p50": 30}, "errors": {}, "slos_ms": None,
               "goodput": 1.5},
              {"request_throughput": 2.0, "ttft_ms": {"p99": 200.0}, "slos_ms": None, "goodput": None}]
    got = median_summary(rounds)
    assert got["request_throughput"] == 2.0
    assert got["ttft_ms"] == {"p99": 200.0, "p50": 20.0}  # p50 from the two rounds that had one
    assert got["errors"] == {"timeout": 1}  # numbers inside dicts too: only one round counted one
    assert got["slos_ms"] is None and got["image"] == {}
    assert got["goodput"] == 1.5  # None in another round: that round had no figure, not a figure of None
    assert median_summary([{}, {}]) == {}


def test_ratios_are_taken_inside_each_round():
    rounds = [{"a": {"request_throughput": 2.0}, "b": {"request_throughput": 3.0}},
              {"a": {"request_throughput": 1.0}, "b": {"request_throughput": 2.0}},
              {"a": {"request_throughput": 1.0}, "b": {}}]  # b failed in round 3
    assert round_ratios(rounds, ["a", "b"], ("request_throughput",)) == {"b": [1.5, 2.0, None]}
    table = round_ratio_table(rounds, ["a", "b"])
    assert "| metric | b / a |" in table
    assert "| req/s | 1.50x, 2.00x, - (median 1.75x) |" in table
    assert "TTFT" not in table  # a metric no round has is left out
    assert round_ratio_table(rounds, ["a"]) == ""  # no baseline to divide by


@pytest.mark.slow
@pytest.mark.parametrize("shared_cluster", [LLAVA_UNIFIED], ids=str, indirect=True)
def test_two_rounds_against_a_server_kept_up(shared_cluster, tmp_path, capsys):
    """The same running cluster named twice (zmq:// and tcp:// are one target under two labels): each round
    replays a new trace in a rotated order, and the report gives medians and each round's ratios."""
    hostport = shared_cluster.address.removeprefix("tcp://")
    configs = [f"zmq://{hostport}", f"tcp://{hostport}"]
    out = tmp_path / "cmp"
    rc = cli_main(["bench", "compare", "--model", "/unused", "--configs", ",".join(configs), "--rounds", "2",
                   "--seed", "5", "--trace", "mixed", "--num-requests", "4", "--max-tokens", "2", "--ignore-eos",
                   "--resolutions", "64x64", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.index(f"round 1/2 [1/2] {configs[0]}") < err.index(f"round 2/2 [1/2] {configs[1]}")  # rotated
    traces = [(out / f"round-{r}" / "trace.jsonl").read_text() for r in range(2)]
    assert traces[0] != traces[1]  # a new trace each round: nothing of round 1 is cached for round 2
    for r in range(2):
        for i, label in enumerate(configs):
            res = json.loads((out / f"round-{r}" / f"{i}-{slug(label)}"
                              / "results.json").read_text())
            assert res["meta"]["seed"] == 5 + r and res["summary"]["overall"]["completed"] == 4
        assert (out / f"round-{r}" / "compare.md").read_text().startswith("| metric |")
    data = json.loads((out / "compare.json").read_text())
    assert len(data["rounds"]) == 2 and not data["failures"] and "2 rounds, seeds 5-6" in data["load"]
    for label in configs:  # the headline summary is the median of the rounds'
        each = [data["rounds"][r][label]["request_throughput"] for r in range(2)]
        assert data["summaries"][label]["request_throughput"] == pytest.approx(sum(each) / 2)
    md = (out / "compare.md").read_text()
    assert "## Median over 2 rounds" in md and f"## Each round's ratio to {configs[0]}" in md
    assert f"| metric | {configs[1]} / {configs[0]} |" in md
