"""Worker -> coordinator membership messages: WorkerLoad is the one spelling of a load's keys, and a
HEARTBEAT carries the worker's READY whole (`Heartbeat.info`)."""

from __future__ import annotations

import dataclasses

import pytest

from mserve.common.protocol import MsgType, ProtocolError, parse_message
from mserve.common.protocol.to_coordinator import TO_COORDINATOR, Heartbeat, WorkerInfo, WorkerLoad, registration_of
from mserve.common.serde import decode, encode
from mserve.coordinator.membership import VIEW_FIGURES, Membership
from mserve.coordinator.requests import RequestMachine
from mserve.coordinator.routing import WorkerView
from mserve.coordinator.settings import MachineSettings
from mserve.gateway.metrics import WORKER_GAUGES
from mserve.status import ROW_FIGURES
from mserve.workers.worker_redis import redis_load


def full_load() -> WorkerLoad:
    """A load with every field set, each to a value of its own."""
    return WorkerLoad(queue_len=1, running=2, free_blocks=3, total_blocks=4, tokens_per_s=5.5, rss_mib=6.5,
                      weights_mib=7.5, kv_pool_mib=8.5, state_kib_per_seq=9.5, encode_s_per_image=0.25,
                      queued=["r1"], draining=True, counters={"steps": 10, "prefix_hits": 2},
                      histograms={"step_seconds": {"count": 1}}, at=123.5, inflight=11)


def info(wid: str = "d0", load: WorkerLoad | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", data_address=f"tcp://{wid}:1", host_id="h", pid=42,
                      num_blocks=4, data_key="k" * 40, model="m", load=load or full_load())


def wire_round_trip(msg):
    frames = encode(msg.KIND, msg.to_body())
    kind, body = decode([bytes(f) for f in frames])
    return parse_message(kind, body, TO_COORDINATOR)


def test_every_load_field_survives_the_wire_and_none_is_left_out():
    load = full_load()
    assert {f.name for f in dataclasses.fields(load) if getattr(load, f.name) is None} == set()
    assert wire_round_trip(info(load=load)).load == load
    assert WorkerLoad().fields() == {}  # an old sender's empty load, and a new one's unreported fields
    assert WorkerLoad.from_body({"v": 1, "free_blocks": 7}) == WorkerLoad(free_blocks=7)


def test_a_misspelt_or_mistyped_load_key_fails_loudly():
    with pytest.raises(TypeError):
        WorkerLoad(free_block=3)  # type: ignore[call-arg]
    with pytest.raises(ProtocolError, match=r"HEARTBEAT.load.free_blocks"):
        parse_message(MsgType.HEARTBEAT, {"v": 1, "worker_id": "d0", "load": {"free_blocks": "3"}}, TO_COORDINATOR)
    # A snapshot reader (status, autoscaler, the coordinator's Redis read) never raises: a bad value reads as None.
    assert WorkerLoad.read({"free_blocks": "3", "running": 2, "draining": 1}) == WorkerLoad(running=2, draining=True)


def test_every_reader_names_only_workerload_fields():
    names = {f.name for f in dataclasses.fields(WorkerLoad)}
    assert set(WORKER_GAUGES) <= names and set(ROW_FIGURES) <= names
    # Every load figure routing keeps is one WorkerLoad declares, so no report is silently dropped.
    view = {f.name for f in dataclasses.fields(WorkerView)}
    assert set(VIEW_FIGURES) == (names & view) - {"inflight"} and "free_blocks" in VIEW_FIGURES


def test_membership_takes_every_figure_and_shows_it():
    members = Membership()
    members.join("d0", info(load=WorkerLoad()), now=0.0)
    load = full_load()
    members.apply_load("d0", load)
    w = members.get("d0")
    assert all(getattr(w, name) == getattr(load, name) for name in VIEW_FIGURES)
    shown = members.status()[0]["d0"]["load"]
    assert shown == {**{name: getattr(load, name) for name in VIEW_FIGURES}, "inflight": 0}
    assert members.is_draining("d0")
    members.apply_load("d0", WorkerLoad(running=9, at=1.0))  # older than the last report: dropped
    assert members.get("d0").running == 2
    members.apply_load("d0", WorkerLoad(running=9))  # a report without `at` and fields left out: kept
    assert members.get("d0").running == 9 and members.get("d0").free_blocks == 3 and members.is_draining("d0")


def test_redis_copy_reads_back_as_the_same_figures():
    load = full_load()
    flat = redis_load(load)
    assert "queued" not in flat and "histograms" not in flat and flat["prefix_hits"] == 2
    stored = {k: int(v) if isinstance(v, bool) else v for k, v in flat.items()}  # Redis keeps a flag as 0/1
    assert WorkerLoad.read(stored) == dataclasses.replace(load, queued=None, counters=None, histograms=None)


def test_heartbeat_carries_the_whole_registration_and_re_admits_a_dead_worker():
    registered = info()
    beat = wire_round_trip(Heartbeat.of(registered))
    assert isinstance(beat, Heartbeat) and beat.info.load == WorkerLoad()  # the load travels once
    assert registration_of(beat) == registered  # data_key, pid, num_blocks included
    assert registration_of(wire_round_trip(registered)) == registered
    assert registration_of(Heartbeat(worker_id="d0", load=WorkerLoad())) is None  # a load-only heartbeat

    machine = RequestMachine(MachineSettings(dead_after_s=1.0), raise_errors=True)
    machine.on_worker("d0", MsgType.READY, registered.to_body(), now=0.0)
    machine.tick(now=5.0)
    assert machine.alive_workers() == []
    machine.on_worker("d0", MsgType.HEARTBEAT, Heartbeat(worker_id="d0", load=WorkerLoad()).to_body(), now=5.1)
    assert machine.alive_workers() == []  # no registration: not re-admitted
    fresh = dataclasses.replace(full_load(), draining=False, at=200.0)
    machine.on_worker("d0", MsgType.HEARTBEAT, Heartbeat.of(info(load=fresh)).to_body(), now=5.2)
    assert machine.alive_workers() == ["d0"]
    w = machine.members.get("d0")
    assert (w.free_blocks, w.running, w.tokens_per_s) == (3, 2, 5.5)  # the heartbeat's load applied on re-admission
