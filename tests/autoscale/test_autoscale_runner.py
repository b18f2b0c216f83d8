"""The autoscaler loop with a stand-in reader and backend: what it applies, what it logs, how it fails."""

from __future__ import annotations

import logging

from mserve.autoscale.backends import BackendError
from mserve.autoscale.policy import Observation, PolicyConfig, PoolObservation, PoolPolicy
from mserve.autoscale.runner import Autoscaler
from mserve.autoscale.signals import Snapshot

FAST = dict(up_cooldown_s=10.0, down_cooldown_s=10.0, down_stable_s=0.0)


class Reader:
    def __init__(self) -> None:
        self.pools = {p: PoolObservation(ready=1) for p in ("encode", "prefill", "decode")}
        self.source = "coordinator"

    def read(self, signals, now):
        if self.source == "none":
            return Snapshot(Observation(now=now, pools=self.pools), source="none", note="nobody answered")
        return Snapshot(Observation(now=now, pools=self.pools), source=self.source)


class Backend:
    name = "fake"

    def __init__(self) -> None:
        self.counts = {"encode": 1, "prefill": 1, "decode": 1}
        self.calls: list[tuple[str, int, int]] = []
        self.fail = False

    def replicas(self, snap):
        return dict(self.counts)

    def scale(self, pool, current, desired):
        self.calls.append((pool, current, desired))
        if self.fail:
            raise BackendError("no can do")
        self.counts[pool] = desired
        return f"set {pool} to {desired}"

    def poll(self):
        return ["decode-x drained and exited (code 0) 0.2s after SIGTERM"] if self.calls else []


def make(clock):
    cfg = PolicyConfig(pools={p: PoolPolicy(**FAST) for p in ("encode", "prefill", "decode")})
    reader, backend = Reader(), Backend()
    return Autoscaler(cfg, backend, reader, interval_s=1, clock=lambda: clock[0]), reader, backend


def test_applies_changes_logs_them_with_reasons_and_respects_cooldown(caplog):
    clock = [0.0]
    scaler, reader, backend = make(clock)
    caplog.set_level(logging.INFO, logger="mserve.autoscale")
    reader.pools["decode"] = PoolObservation(ready=1, load=9)
    out = scaler.tick()
    assert out["decode"].desired == 3 and backend.calls == [("decode", 1, 3)]
    assert any(r.getMessage().startswith("decode: 1 -> 3 (up): load 9 sequences = 9.00 per replica > 4 | set "
                                         "decode to 3") for r in caplog.records)
    clock[0] = 1.0
    reader.pools["decode"] = PoolObservation(ready=3, load=0)
    assert scaler.tick()["decode"].rule == "cooldown" and len(backend.calls) == 1
    assert any("drained and exited" in r.getMessage() for r in caplog.records)  # the backend's events
    clock[0] = 12.0
    assert scaler.tick()["decode"].desired == 2 and backend.calls[-1] == ("decode", 3, 2)
    assert [d.pool for _, d, _ in scaler.history] == ["decode", "decode"]


def test_a_failed_change_is_logged_and_retried_after_the_cooldown(caplog):
    clock = [0.0]
    scaler, reader, backend = make(clock)
    backend.fail = True
    reader.pools["prefill"] = PoolObservation(ready=1, load=9)
    scaler.tick()
    assert any("FAILED: no can do" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    clock[0] = 5.0
    scaler.tick()
    assert len(backend.calls) == 1  # not hammered every tick
    clock[0] = 11.0
    backend.fail = False
    scaler.tick()
    assert backend.calls[-1] == ("prefill", 1, 3) and backend.counts["prefill"] == 3


def test_without_any_observation_every_pool_holds(caplog):
    clock = [0.0]
    scaler, reader, backend = make(clock)
    reader.source = "none"
    reader.pools["decode"] = PoolObservation(ready=1, load=99)
    assert scaler.tick() == {} and backend.calls == []
    assert any("no observation (nobody answered)" in r.getMessage() for r in caplog.records)
