"""Routing policy without sockets: affinity, load, spare blocks, and when to wait."""

from __future__ import annotations

from mserve.coordinator.routing import (WorkerView, pipeline_for, prefix_covered, route_decode, route_encode,
                                        route_lend_adaptive, route_local_prefill, route_prefill, route_unified,
                                        spread_encode)


def w(wid: str, role: str, **kw) -> WorkerView:
    return WorkerView(wid, role, **kw)


def test_encode_prefers_the_worker_holding_the_images_then_the_least_busy():
    ws = [w("e0", "encode", inflight=3), w("e1", "encode"), w("e2", "encode", inflight=1)]
    assert route_encode(ws, ["a"], {}).worker_id == "e1"
    assert route_encode(ws, ["a", "b"], {"a": {"e2"}, "b": {"e2", "e0"}}).worker_id == "e2"
    assert route_encode([w("e0", "encode", alive=False)], ["a"], {}) is None


def test_adaptive_lending_lends_where_the_time_saved_exceeds_what_it_costs_the_decode_worker():
    """Prefill-heavy: prompts queue at the prefill worker while a decode worker holds little; decode-heavy:
    the decode worker holds a full batch and the prefill worker keeps up. Counted in prompt tokens."""
    idle = w("d0", "decode", free_blocks=100, total_blocks=100)
    one = w("d1", "decode", free_blocks=100, total_blocks=100, inflight=1, inflight_tokens=0)
    # Prefill-heavy: 4 prompts of 700 queued at p0. Lent to the idle decode worker (saves 2,800 tokens of
    # waiting, costs nobody anything) before the one holding a request (saves 2,800, costs 700).
    behind = w("p0", "prefill", inflight_tokens=2800)
    assert route_lend_adaptive(behind, [one, idle], 700, 50).worker_id == "d0"
    assert route_lend_adaptive(behind, [one], 700, 50).worker_id == "d1"
    # Decode-heavy: 16 requests decoding (reported running, or the coordinator's own count), p0 keeping up.
    busy = [w("d0", "decode", free_blocks=100, total_blocks=100, running=16),
            w("d1", "decode", free_blocks=100, total_blocks=100, inflight=16)]
    assert route_lend_adaptive(w("p0", "prefill", inflight_tokens=700), busy, 700, 50) is None
    # Even with a backlog, a full batch's delay outweighs what one prompt saves: 2,800 < 16 x 700.
    assert route_lend_adaptive(behind, busy, 700, 50) is None
    # Nothing queued at the prefill worker: nothing to save, whatever the decode worker holds.
    assert route_lend_adaptive(w("p0", "prefill"), [idle], 700, 50) is None
    # Room for the whole request, and alive, or not at all.
    assert route_lend_adaptive(behind, [w("d0", "decode", free_blocks=10, total_blocks=100)], 700, 50) is None
    assert route_lend_adaptive(behind, [w("d0", "decode", alive=False)], 700, 50) is None
    # A decode worker with as much prompt work queued as the prefill worker saves nothing.
    assert route_lend_adaptive(behind, [w("d0", "decode", inflight_tokens=2800)], 700, 50) is None


def test_prefill_balances_pending_tokens_and_credits_cached_prefixes():
    ws = [w("p0", "prefill", inflight_tokens=2000), w("p1", "prefill", inflight_tokens=500)]
    assert route_prefill(ws, 600).worker_id == "p1"
    # p0 already holds 120 blocks of this prompt: cheaper despite its queue.
    assert route_prefill(ws, 2000, {"p0": 120}, block_size=16).worker_id == "p0"


def test_a_prefill_worker_behind_lends_the_prompt_to_a_decode_worker_with_room_and_less_waiting():
    p = w("p0", "prefill", inflight_tokens=1400)
    ds = [w("d0", "decode", free_blocks=100, total_blocks=100, inflight=3),
          w("d1", "decode", free_blocks=100, total_blocks=100, inflight=1)]
    assert route_local_prefill(p, ds, 700, 50, backlog_tokens=0) is None  # off
    assert route_local_prefill(p, ds, 700, 50, backlog_tokens=1500) is None  # not behind enough
    assert route_local_prefill(p, ds, 700, 50, backlog_tokens=1400).worker_id == "d1"  # the less busy
    assert route_local_prefill(p, ds, 700, 120, backlog_tokens=1000) is None  # no decode worker has the blocks
    # A decode worker with as much prompt work waiting as the prefill worker would have gains nothing.
    lent = [w("d0", "decode", inflight_tokens=1400), w("d1", "decode", alive=False)]
    assert route_local_prefill(p, lent, 700, 50, backlog_tokens=1000) is None
    assert route_local_prefill(p, [w("d0", "decode", inflight_tokens=1399)], 700, 50, 1000).worker_id == "d0"


def test_decode_goes_where_blocks_are_free():
    ws = [w("d0", "decode", free_blocks=10, total_blocks=100), w("d1", "decode", free_blocks=90, total_blocks=100,
                                                                     inflight=2)]
    assert route_decode(ws, 20).worker_id == "d1"  # d0 cannot fit it
    both_fit = [w("d0", "decode", free_blocks=50, total_blocks=100), w("d1", "decode", free_blocks=90,
                                                                         total_blocks=100, inflight=2)]
    assert route_decode(both_fit, 20).worker_id == "d0"  # both fit: the less busy one
    assert route_decode(ws, 500).worker_id == "d1"  # nobody fits: the most spare blocks


def test_pipeline_choice_skips_encode_for_text_and_falls_back_to_unified():
    disagg = [w("p", "prefill"), w("d", "decode")]
    assert pipeline_for(disagg, has_images=False) == "disagg"
    assert pipeline_for(disagg, has_images=True) is None  # no encode pool: wait
    assert pipeline_for(disagg + [w("u", "unified")], has_images=True) == "unified"
    assert pipeline_for([w("u", "unified")], has_images=False) == "unified"
    assert route_unified([w("u0", "unified", queue_len=4), w("u1", "unified")]).worker_id == "u1"


def test_encode_counts_the_hosts_shared_cache_and_weighs_reencoding_by_measured_cost():
    e0 = w("e0", "encode", host_id="h1", encode_s_per_image=0.1)
    e1 = w("e1", "encode", host_id="h2", encode_s_per_image=0.1)
    # Only host h2's shared (L2) cache holds the image: e1 reads it back instead of e0 encoding it.
    assert route_encode([e0, e1], ["a"], {"a": {"host:h2"}}).worker_id == "e1"
    # A busy holder still wins while a read-back (at most one forward's wait) beats two encodes...
    e1.inflight = 4
    assert route_encode([e0, e1], ["a", "b"], {"a": {"e1"}, "b": {"e1"}}).worker_id == "e1"
    # ...but not against an idle worker on a host that holds the images too,
    assert route_encode([e0, e1], ["a", "b"], {"a": {"e1", "host:h1"}, "b": {"host:h1"}}).worker_id == "e0"
    # and a holder that is slow (measured) loses to re-encoding one image on a fast idle worker.
    slow = w("e2", "encode", host_id="h3", encode_s_per_image=0.5, inflight=1)
    fast = w("e3", "encode", host_id="h4", encode_s_per_image=0.05)
    assert route_encode([slow, fast], ["a"], {"a": {"e2"}}).worker_id == "e3"


def test_spread_encode_deals_the_misses_to_idle_encoders_and_keeps_held_images_on_the_primary():
    e0, e1, e2 = w("e0", "encode", host_id="h0"), w("e1", "encode", host_id="h1"), w("e2", "encode", host_id="h2")
    ids = lambda parts: [(p.worker_id, images) for p, images in parts]  # noqa: E731
    # Two misses, one idle helper: one image each, at the same time.
    assert ids(spread_encode(e0, [e0, e1, e2], ["a", "b"], {})) == [("e0", [0]), ("e1", [1])]
    # Image 1 is on the primary's host (L2): it stays there, with one of the misses; the other miss goes out.
    assert ids(spread_encode(e0, [e0, e1, e2], ["a", "b", "c"], {"b": {"host:h0"}})) == [("e0", [0, 1]), ("e1", [2])]
    # Four misses over three idle encoders: dealt in turn, the primary first.
    assert ids(spread_encode(e0, [e0, e1, e2], list("abcd"), {})) == [("e0", [0, 3]), ("e1", [1]), ("e2", [2])]
    # One miss, or no other idle encoder (busy or dead): the primary takes everything, as before.
    assert ids(spread_encode(e0, [e0, e1], ["a", "b"], {"a": {"e0"}})) == [("e0", [0, 1])]
    busy = w("e1", "encode", inflight=1)
    dead = w("e2", "encode", alive=False)
    assert ids(spread_encode(e0, [e0, busy, dead], ["a", "b"], {})) == [("e0", [0, 1])]
    # Helpers are the idle encoders measured fastest first.
    slow, fast = w("e1", "encode", encode_s_per_image=0.5), w("e2", "encode", encode_s_per_image=0.05)
    assert ids(spread_encode(e0, [e0, slow, fast], ["a", "b"], {})) == [("e0", [0]), ("e2", [1])]


def test_prefix_covered_counts_only_images_whole_in_the_reusable_blocks():
    # Images ending at 40, 70 and 100 in a 120-token prompt; the worker holds 4 blocks of 16 (64 tokens).
    assert prefix_covered([40, 70, 100], 120, 4, 16) == [0]  # the second ends past 64: partly held, encoded
    assert prefix_covered([40, None, 100], 120, 7, 16) == [0, 2]  # None: never skipped (a video)
    # The block holding the prompt's last token is never reused: 7 blocks held, 6 usable (96 tokens).
    assert prefix_covered([40, 100], 100, 7, 16) == [0]
    assert prefix_covered([40], 120, 0, 16) == []


def test_unified_routing_credits_the_cached_prefix_against_load():
    idle, holder = w("u0", "unified"), w("u1", "unified", running=2, inflight_tokens=100)
    assert route_unified([idle, holder], 700).worker_id == "u0"  # no hits: the idle one
    assert route_unified([idle, holder], 700, {"u1": 42}, 16).worker_id == "u1"  # 672 tokens held there
    assert route_unified([idle, holder], 700, {"u1": 5}, 16).worker_id == "u0"  # 80 held: not worth the wait
