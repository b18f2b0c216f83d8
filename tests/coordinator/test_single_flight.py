"""Single-flight encodes: the pure policy (coordinator/single_flight.py) and the request machine using it."""

from __future__ import annotations

from mserve.common.protocol import MsgType
from mserve.coordinator.admission import Admitted, AdmittedImage
from mserve.coordinator.single_flight import SingleFlight
from tests.coordinator.test_request_machine import CLIENT, DEAD_AFTER, DISAGG, Harness, kinds, make_admitted, only


class DictLeases:
    """Leases as one dict shared by several SingleFlights: shards of one cluster, without Redis."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}

    def claim(self, image_hash: str, owner: str, ttl_s: float) -> bool:
        return self.owner.setdefault(image_hash, owner) == owner

    def renew(self, image_hashes: list[str], owner: str, ttl_s: float) -> None:
        pass

    def release(self, image_hashes: list[str], owner: str) -> None:
        for h in image_hashes:
            if self.owner.get(h) == owner:
                del self.owner[h]


def with_images(rid: str, hashes: list[str]) -> Admitted:
    adm = make_admitted(rid, images=len(hashes))
    adm.images[:] = [AdmittedImage(hash=h, data=b"png", size=(28, 28), num_tokens=4) for h in hashes]
    return adm


# -- the policy alone ---------------------------------------------------------------------------------

def test_the_first_request_leads_later_ones_park_and_wake_when_it_is_encoded():
    f = SingleFlight()
    assert f.may_encode("a", ["x"], {}, since=1.0)
    assert not f.may_encode("b", ["x"], {}, since=2.0) and not f.may_encode("c", ["x"], {}, since=3.0)
    assert f.may_encode("a", ["x"], {}, since=1.0)  # the leader asking again still leads
    woken = f.encoded(["x"])
    assert [(p.rid, p.since) for p in woken] == [("b", 2.0), ("c", 3.0)] and not f.parked and not f.leader
    held = {"x": {"e0"}}
    assert f.may_encode("b", ["x"], held, since=2.0)  # held now: nothing to claim
    assert f.prefer("b", held) == {"e0"} and f.deduplicated("b", held) == 1 and f.deduplicated("b", held) == 0


def test_a_held_image_is_never_claimed_and_nobody_waits_for_it():
    f = SingleFlight()
    assert f.may_encode("a", ["x"], {"x": {"e1"}}, since=0.0) and not f.leader
    assert f.may_encode("b", ["x"], {"x": {"e1"}}, since=0.0) and f.deduplicated("b", {"x": {"e1"}}) == 0


def test_a_failed_leader_wakes_its_waiters_and_the_first_one_back_takes_over():
    f = SingleFlight()
    assert f.may_encode("a", ["x"], {}, since=0.0)
    assert not f.may_encode("b", ["x"], {}, since=1.0) and not f.may_encode("c", ["x"], {}, since=2.0)
    assert [p.rid for p in f.release("a")] == ["b", "c"]
    assert f.may_encode("b", ["x"], {}, since=1.0) and not f.may_encode("c", ["x"], {}, since=2.0)
    assert f.leader == {"x": "b"}
    assert f.deduplicated("b", {}) == 0  # it encodes the image itself: nothing saved


def test_a_request_waits_for_the_images_in_flight_and_leads_the_rest_once_they_are_in():
    f = SingleFlight()
    assert f.may_encode("a", ["x"], {}, since=0.0)
    assert not f.may_encode("b", ["x", "y"], {}, since=1.0)
    assert "y" not in f.leader  # parked, it claims nothing: a third request for y is not held up
    assert f.may_encode("c", ["y"], {}, since=2.0)
    assert [p.rid for p in f.encoded(["x"])] == ["b"]
    assert not f.may_encode("b", ["x", "y"], {"x": {"e0"}}, since=1.0)  # y is c's now
    assert [p.rid for p in f.encoded(["y"])] == ["b"]
    assert f.may_encode("b", ["x", "y", "z"], {"x": {"e0"}, "y": {"e1"}}, since=1.0)
    assert f.leader == {"z": "b"} and f.deduplicated("b", {"x": {"e0"}, "y": {"e1"}}) == 2


def test_shards_share_leases_and_a_request_parked_on_another_shard_looks_again_on_poll():
    leases = DictLeases()
    s1, s2 = SingleFlight(leases, owner="s1"), SingleFlight(leases, owner="s2")
    assert s1.may_encode("a", ["x", "y"], {}, since=0.0)
    assert not s2.may_encode("b", ["z", "y"], {}, since=0.0)
    assert leases.owner == {"x": "s1", "y": "s1"}  # b took z and gave it back: all or nothing
    assert s2.poll(0.0)[0].rid == "b" and s2.poll(0.1) == []  # every poll_s, not every tick
    assert not s2.may_encode("b", ["z", "y"], {}, since=0.0)
    s1.encoded(["x", "y"])
    assert leases.owner == {}
    assert [p.rid for p in s2.poll(1.0)] == ["b"]
    assert s2.may_encode("b", ["z", "y"], {"y": {"e0"}}, since=0.0) and leases.owner == {"z": "s2"}
    assert s2.deduplicated("b", {"y": {"e0"}}) == 1


def test_an_ended_request_leaves_nothing_behind():
    f = SingleFlight()
    assert f.may_encode("a", ["x"], {}, since=0.0) and not f.may_encode("b", ["x"], {}, since=0.0)
    f.forget("b")
    assert f.release("a") == [] and not (f.leader or f.claims or f.parked or f.waited)


# -- the request machine ------------------------------------------------------------------------------

def test_a_burst_for_one_image_sends_one_encode_and_the_rest_read_it_back_from_the_holder():
    h = Harness(*DISAGG)
    out = []
    for i in range(4):
        out += h.submit(with_images(f"r{i}", ["same"]))
    encodes = [m for m in out if m.kind is MsgType.ENCODE]
    assert kinds(encodes) == [("ENCODE", "e0")] and h.m.status()["encode_parked"] == 3
    out = h.encoded("e0", encodes[0])
    # The leader goes on to prefill; the three that waited all read the image back from e0, the idle e1 unused.
    assert kinds([m for m in out if m.kind is MsgType.ENCODE]) == [("ENCODE", "e0")] * 3
    assert only(out, MsgType.PREFILL).body["request_id"] == encodes[0].body["request_id"]
    assert h.m.stats["encode_deduplicated"] == 3 and h.m.status()["encode_parked"] == 0


def test_the_encoder_of_the_single_flight_dies_and_one_waiter_takes_over():
    h = Harness(*DISAGG)
    first = only(h.submit(with_images("r0", ["same"])), MsgType.ENCODE, "e0")
    assert h.submit(with_images("r1", ["same"])) == [] and h.submit(with_images("r2", ["same"])) == []
    out = h.advance(DEAD_AFTER + 1, beating=("e1", "p0", "p1", "d0", "d1"))  # e0 falls silent mid-encode
    encodes = [m for m in out if m.kind is MsgType.ENCODE]
    assert kinds(encodes) == [("ENCODE", "e1")] and h.m.status()["encode_parked"] == 2
    assert h.encoded("e0", first) == []  # the dead encoder's late reply is stale...
    out = h.encoded("e1", encodes[0])
    assert kinds([m for m in out if m.kind is MsgType.ENCODE]) == [("ENCODE", "e1")] * 2  # ...e1 holds it now
    assert h.m.stats["encode_deduplicated"] == 2


def test_an_aborted_leader_hands_the_encode_to_a_waiter():
    h = Harness(*DISAGG)
    only(h.submit(with_images("r0", ["same"])), MsgType.ENCODE, "e0")
    assert h.submit(with_images("r1", ["same"])) == []
    out = h.m.abort(CLIENT, "r0", now=h.t)
    enc = only(out, MsgType.ENCODE)
    assert h.client_rid(enc) == "r1" and h.m.stats["encode_deduplicated"] == 0


def test_a_failed_leader_encode_reruns_and_its_waiter_does_not_encode_twice():
    h = Harness(*DISAGG)
    first = only(h.submit(with_images("r0", ["same"])), MsgType.ENCODE, "e0")
    assert h.submit(with_images("r1", ["same"])) == []
    out = h.failed("e0", first)
    encodes = [m for m in out if m.kind is MsgType.ENCODE]
    assert len(encodes) == 1 and h.m.status()["encode_parked"] == 1  # one of the two encodes, the other waits


def test_single_flight_off_sends_every_encode_at_once():
    h = Harness(*DISAGG, encode_single_flight=False)
    out = h.submit(with_images("r0", ["same"])) + h.submit(with_images("r1", ["same"]))
    assert kinds(out) == [("ENCODE", "e0"), ("ENCODE", "e1")] and h.m.stats["encode_deduplicated"] == 0


def test_a_request_waits_for_one_part_of_a_spread_encode_and_reads_it_from_that_part_s_encoder():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(with_images("r0", ["x", "y"]))  # spread: x on e0, y on e1
    assert [im["hash"] for im in e1.body["images"]] == ["y"]
    assert h.submit(with_images("r1", ["y", "z"])) == []  # y is in flight: parked, z not claimed
    out = h.encoded("e1", e1)
    enc = only(out, MsgType.ENCODE)
    assert enc.worker_id == "e1" and h.client_rid(enc) == "r1"  # y's holder; it encodes z there itself
    assert h.m.stats["encode_deduplicated"] == 1 and h.m.ctx.flights.leader == {"x": "rid0", "z": "rid1"}
