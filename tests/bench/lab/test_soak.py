"""The CI-sized soak (python -m lab.soak): past saturation, then nothing may have leaked."""

from __future__ import annotations

import pytest

from lab.soak import markdown, parse_pools, run_soak

pytestmark = pytest.mark.slow


def test_short_soak_past_saturation_ends_every_request_once_and_leaks_nothing(tiny_model_dirs, redis_url):
    r = run_soak(str(tiny_model_dirs["llava"]), duration_s=12, rate=60, pools=parse_pools("1e1p1d"),
                 max_waiting=8, max_tokens=24, redis_url=redis_url)
    report = markdown(r)
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["ended_exactly_once"] == r["requests"], report
    assert set(r["outcomes"]) <= {"ok", "overloaded"}, report  # shed requests got the explicit error
    assert r["outcomes"].get("ok", 0) > 0 and r["outcomes"].get("overloaded", 0) > 0, report
    assert r["drained"] and r["requests_in_flight_after"] == 0 and r["kv_integrity"], report
    assert r["shm_segments"]["end"] <= r["shm_segments"]["start"] + 64, report  # the pools' reuse bound
    for name, rss in r["rss_mib"].items():  # caches fill up to their bounds; nothing grows past them
        assert rss["end"] - rss["start"] < 600, f"{name}: {report}"


def test_pool_specs():
    assert parse_pools("2e1p3d") == {"encode": 2, "prefill": 1, "decode": 3}
    assert parse_pools("unified:2")["unified"] == 2
    with pytest.raises(Exception, match="1e1p1d"):
        parse_pools("three")
