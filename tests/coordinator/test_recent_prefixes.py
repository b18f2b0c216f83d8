"""The coordinator remembers where it just sent each prompt, so a conversation's next turn finds the
worker holding its prefix before that worker's Redis index publish (coordinator/recent_prefixes.py)."""

from __future__ import annotations

from mserve.common.hashing import prompt_block_hashes
from mserve.common.protocol import MsgType
from mserve.coordinator.recent_prefixes import RecentPrefixes, merge_hits
from mserve.coordinator.records import NoLookups
from mserve.coordinator.requests import Stage
from tests.coordinator.test_request_machine import DEAD_AFTER, Harness, make_admitted, only


def test_match_counts_each_workers_leading_run_of_the_chain():
    recent = RecentPrefixes()
    recent.placed(["a", "b", "c"], "u0")
    recent.placed(["a", "b"], "u1")
    recent.placed(["x", "c"], "u2")  # holds "c" but not the blocks before it: no credit for it
    assert recent.match(["a", "b", "c", "d"]) == {"u0": 3, "u1": 2}
    assert recent.match(["b", "c"]) == {"u0": 2, "u1": 1}  # u2 holds "c" without "b"
    assert recent.match(["z"]) == {} and recent.match([]) == {}


def test_capacity_drops_the_least_recently_placed_and_forget_drops_a_worker():
    recent = RecentPrefixes(capacity=3)
    recent.placed(["a", "b"], "u0")
    recent.placed(["c", "d"], "u1")  # "a" is the oldest: dropped
    assert len(recent) == 3 and recent.match(["a", "b"]) == {} and recent.match(["c", "d"]) == {"u1": 2}
    recent.placed(["c"], "u0")
    recent.forget("u1")
    assert recent.match(["c", "d"]) == {"u0": 1} and len(recent) == 2  # "d" had only u1: gone


def test_merge_keeps_each_workers_longest_credit():
    assert merge_hits({"u0": 2, "u1": 5}, {"u0": 4}, {}) == {"u0": 4, "u1": 5}


class RecentOnly(NoLookups):
    """What the coordinator's Redis lookups do when the index has not caught up yet: only recent placements."""

    def __init__(self) -> None:
        self.recent = RecentPrefixes()

    def prefix_hits(self, admitted, block_size, sent_since=None):
        return self.recent.match(prompt_block_hashes(admitted.prompt_ids, block_size), since=sent_since)

    def placed(self, admitted, block_size, worker_id, now=0.0):
        self.recent.placed(prompt_block_hashes(admitted.prompt_ids, block_size), worker_id, now)

    def forget(self, worker_id):
        self.recent.forget(worker_id)


def admitted(rid: str, ids: range):
    adm = make_admitted(rid, prompt_len=len(ids))
    adm.prompt_ids = list(ids)
    return adm


def test_next_turn_goes_to_the_unified_worker_it_was_just_sent_to_even_when_that_one_is_busier():
    h = Harness(("u0", "unified"), ("u1", "unified"), lookups=RecentOnly())
    run1 = only(h.submit(admitted("t1", range(100, 300))), MsgType.RUN)
    first = run1.worker_id
    h.step(first, run1, [7], finished=True)
    # Two unrelated prompts, one each: the longer one where turn 1 ran (both idle: the tie goes there).
    long = only(h.submit(admitted("long", range(6000, 6100))), MsgType.RUN)
    short = only(h.submit(admitted("short", range(5000, 5040))), MsgType.RUN)
    assert long.worker_id == first and short.worker_id != first
    # Turn 2 carries turn 1's 200 tokens first: it goes where those 12 blocks are, even if that worker
    # has the longer prompt in flight.
    run2 = only(h.submit(admitted("t2", range(100, 500))), MsgType.RUN)
    assert run2.worker_id == first
    assert h.m.requests[run2.body["request_id"]].stage == Stage.RUN


def test_a_dead_worker_gets_no_credit_for_what_it_was_sent():
    h = Harness(("u0", "unified"), ("u1", "unified"), lookups=RecentOnly())
    run1 = only(h.submit(admitted("t1", range(100, 300))), MsgType.RUN)
    h.step(run1.worker_id, run1, [7], finished=True)
    other = "u1" if run1.worker_id == "u0" else "u0"
    h.advance(3 * DEAD_AFTER, beating=(other,))  # the first one falls silent: declared dead
    assert not h.m.members.is_alive(run1.worker_id)
    assert h.m.ctx.lookups.prefix_hits(admitted("t2", range(100, 500)), 16) == {}
    assert only(h.submit(admitted("t2", range(100, 500))), MsgType.RUN).worker_id == other


def test_a_unified_request_that_decodes_no_longer_weighs_as_prefill_work():
    h = Harness(("u0", "unified"), ("u1", "unified"), lookups=RecentOnly())
    run1 = only(h.submit(admitted("t1", range(100, 300))), MsgType.RUN)
    first = run1.worker_id
    h.step(first, run1, [7], finished=True)
    long = only(h.submit(admitted("long", range(6000, 6600))), MsgType.RUN)
    assert long.worker_id == first
    view = h.m.members.get(first)
    assert (view.inflight, view.inflight_tokens) == (1, 600)
    h.step(first, long, [1], first=True)  # its first token: prefilled, now decoding
    assert (view.inflight, view.inflight_tokens) == (1, 0)
    # Turn 2 goes where turn 1's blocks are: behind one decoding sequence, not behind 600 prompt tokens.
    assert only(h.submit(admitted("t2", range(100, 500))), MsgType.RUN).worker_id == first
    h.step(first, long, [2], finished=True)
    # t2's charge only, less the 12 blocks (192 tokens) routing credited it with there: nothing went negative
    assert (view.inflight, view.inflight_tokens) == (1, 400 - 192)


def test_since_counts_only_what_was_sent_from_then_on():
    recent = RecentPrefixes()
    recent.placed(["a", "b"], "u0", now=1.0)
    recent.placed(["a", "b", "c"], "u1", now=9.0)
    assert recent.match(["a", "b", "c"], since=5.0) == {"u1": 3}
    assert recent.match(["a", "b", "c"]) == {"u0": 2, "u1": 3}  # routing: every placement
    recent.placed(["a"], "u0", now=10.0)  # sent again: fresh again, for the blocks it was sent
    assert recent.match(["a", "b"], since=5.0) == {"u0": 1, "u1": 2}


def held_images(rid: str):
    adm = make_admitted(rid, images=2, prompt_len=80)
    for i, (im, end) in enumerate(zip(adm.images, (20, 50))):
        im.hash, im.end, im.skippable = f"img-{i}", end, True  # the same images in every request
    return adm


def test_an_encode_skip_trusts_what_the_coordinator_sent_only_until_the_index_has_caught_up():
    """The same two-image prompt again: right after the first was sent to prefill, its images are not
    encoded (the prefill worker holds them, and Redis may not know yet); after SKIP_HORIZON_S only the
    Redis index counts (here it holds nothing: the worker evicted the blocks), so both are encoded,
    where before the skip was planned and the PREFILL failed and ran again (a re-run)."""
    from mserve.coordinator.recent_prefixes import SKIP_HORIZON_S
    from tests.coordinator.test_request_machine import DISAGG

    h = Harness(*DISAGG, lookups=RecentOnly())
    h.m.settings.spread_encode = False
    enc = only(h.submit(held_images("first")), MsgType.ENCODE)
    pre = only(h.encoded(enc.worker_id, enc), MsgType.PREFILL)
    dec = only(h.prefilled(pre.worker_id, pre, 7), MsgType.DECODE)
    only(h.step(dec.worker_id, dec, [8], finished=True), MsgType.RESULT)
    again = only(h.submit(held_images("soon")), MsgType.PREFILL)  # within the horizon: skipped, sent there
    assert again.worker_id == pre.worker_id and again.body["skipped_images"] == [0, 1]
    dec = only(h.prefilled(again.worker_id, again, 7, skipped_images=2), MsgType.DECODE)
    only(h.step(dec.worker_id, dec, [8], finished=True), MsgType.RESULT)
    h.advance(SKIP_HORIZON_S + 1, beating=tuple(w for w, _ in DISAGG))
    later = only(h.submit(held_images("later")), MsgType.ENCODE)
    assert [im["hash"] for im in later.body["images"]] == ["img-0", "img-1"]
    assert h.m.stats["reruns"] == 0
