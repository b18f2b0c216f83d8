"""The sharded coordinator calibration (python -m lab.coord_shards), CI-sized: K = 1 and K = 2 real
coordinator shards driven by fake workers; every request answered by the shard its id hashes to."""

from __future__ import annotations

import json

import pytest

from lab import coord_calibrate, coord_shards

pytestmark = pytest.mark.slow


def test_two_shards_side_by_side_with_one(tiny_model_dirs, redis_url):
    out = coord_shards.measure_shards(str(tiny_model_dirs["llava"]), shards=2, scale=0.01, idle_s=0.3,
                                      redis_url=redis_url)
    report = coord_shards.table(out)
    assert [c["shards"] for c in out["configs"]] == [1, 2], report
    for c in out["configs"]:
        assert [r["modality"] for r in c["runs"]] == ["image", "text"], report
        for r in c["runs"]:
            assert r["requests"] == out["counts"][r["modality"]] and r["results"] == r["requests"], report
            # Each request was sent to one shard and got its RESULT from that shard.
            assert sum(s["requests"] for s in r["shards"]) == r["requests"], report
            assert all(s["results"] == s["requests"] > 0 for s in r["shards"]), report
            assert r["requests_per_s"] > 0 and r["coordinator_cpu_per_request_s"] > 0, report
            assert r["driver_cpu_per_request_s"] > 0 and r["wall_s"] > 0, report
            assert r["messages"]["step_msgs"] > 0 and r["messages"]["token_items"] > 0, report
            assert all(s["cpu_s"] > 0 for s in r["shards"]), report
            assert sum(s["share"] for s in r["shards"]) == pytest.approx(1.0), report
        assert [s["shard"] for s in c["idle_by_shard"]] == [f"shard-{i}" for i in range(c["shards"])], report
        assert [i["workers"] for i in c["idle"]] == list(coord_shards.IDLE_WORKERS), report
    json.dumps(out)
    assert "shard-1" in report and "per worker" in report


def test_coord_calibrate_shards_flag_runs_coord_shards(monkeypatch):
    seen = []
    monkeypatch.setattr(coord_shards, "main", lambda argv: seen.append(argv) or 0)
    assert coord_calibrate.main(["--model", "m", "--shards", "3", "--json-out", "/tmp/x.json"]) == 0
    assert seen == [["--model", "m", "--shards", "3", "--scale", "1.0", "--json-out", "/tmp/x.json"]]
