"""The coordinator's request state machine without sockets, Redis, a model or a real clock.

Workers are hand-made READY / HEARTBEAT / ENCODED / PREFILLED / STEP_TOKENS / FAILED payloads; the
clock is a number the test moves; assertions are on the messages the machine returns.
"""

from __future__ import annotations

from typing import Any

import pytest

from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.client import Error, Generate, Sampling
from mserve.common.protocol.to_coordinator import Heartbeat, WorkerInfo, WorkerLoad
from mserve.coordinator.admission import Admitted, AdmittedImage
from mserve.coordinator.records import NoLookups
from mserve.coordinator.requests import RequestMachine, Stage, ToClient, ToWorker
from mserve.coordinator.settings import MachineSettings

CLIENT = b"client-1"
TIMEOUT = 5.0
DEAD_AFTER = 2.0


def make_admitted(rid: str = "r1", *, images: int = 0, prompt_len: int = 20, max_tokens: int = 8,
                  stream: bool = False, priority: int = 0, latency_class: str = "interactive") -> Admitted:
    req = Generate(request_id=rid, messages=[{"role": "user", "content": "hi"}],
                   sampling=Sampling(max_tokens=max_tokens), stream=stream, priority=priority,
                   latency_class=latency_class)
    ims = [AdmittedImage(hash=f"img-{rid}-{i}", data=b"png", size=(28, 28), num_tokens=4) for i in range(images)]
    return Admitted(req, list(range(100, 100 + prompt_len)), ims)


def kv_state(rid: str) -> dict[str, Any]:
    """A prefill worker's hand-off state (KVState), which the coordinator relays to decode as it came."""
    return {"request_id": rid, "prompt_ids": [1, 2], "output_ids": [], "num_computed_tokens": 2, "block_size": 16,
            "images": [], "sampling": {"max_tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                       "stop_token_ids": [], "ignore_eos": False},
            "rope_delta": 0, "priority": 0, "latency_class": "interactive"}


class Harness:
    """A RequestMachine, a fake clock, and helpers that speak for workers."""

    def __init__(self, *roles: tuple[str, str], max_attempts: int = 3, max_waiting: int = 256, max_stages: int = 0,
                 aging: float = 10.0, **kw: Any) -> None:
        self.t = 0.0
        self.ids = iter(f"rid{i}" for i in range(1000))
        settings = MachineSettings(stage_timeout_s=TIMEOUT, dead_after_s=DEAD_AFTER, max_attempts=max_attempts,
                                   max_waiting_requests=max_waiting, max_stages_per_worker=max_stages,
                                   class_aging_s=aging, **{k: kw.pop(k) for k in list(kw) if k in MachineSettings.model_fields})
        self.m = RequestMachine(settings, detokenize=lambda ids: " ".join(map(str, ids)), new_id=lambda: next(self.ids),
                                raise_errors=True, **kw)
        for wid, role in roles:
            assert self.join(wid, role) == []

    def join(self, wid: str, role: str, kind: MsgType = MsgType.READY, **load: Any) -> list:
        info = WorkerInfo(worker_id=wid, role=role, data_address=f"tcp://{wid}", host_id="h", block_size=16,
                          load=WorkerLoad(**{"queue_len": 0, "running": 0, "free_blocks": 1000, "total_blocks": 1000,
                                             **load}))
        return self.m.on_worker(wid, kind, (info if kind == MsgType.READY else Heartbeat.of(info)).to_body(),
                                now=self.t)

    def worker(self, wid: str, kind: MsgType, **payload: Any) -> list:
        return self.m.on_worker(wid, kind, payload, now=self.t)

    def submit(self, adm: Admitted) -> list:
        return self.m.submit(CLIENT, adm, now=self.t)

    def advance(self, dt: float, *, beating: tuple[str, ...] = ()) -> list:
        """Move the clock in small steps, the listed workers heartbeating, ticking as the loop does."""
        out = []
        end = self.t + dt
        while self.t < end:
            self.t = min(end, self.t + DEAD_AFTER / 4)
            for wid in beating:
                out += self.worker(wid, MsgType.HEARTBEAT, worker_id=wid, load={})
            out += self.m.tick(now=self.t)
        return out

    # worker replies -------------------------------------------------------------------------------
    def encoded(self, wid: str, stage_msg: ToWorker, **kw: Any) -> list:
        b = stage_msg.body
        return self.worker(wid, MsgType.ENCODED, request_id=b["request_id"], attempt=b["attempt"],
                           descriptor={"from": wid, "attempt": b["attempt"]},
                           images=[{"hash": im["hash"], "tokens": 4, "grid": [1, 2, 2]} for im in b["images"]], **kw)

    def prefilled(self, wid: str, stage_msg: ToWorker, token: int, finish: str = "prefilled", **kw: Any) -> list:
        b = stage_msg.body
        return self.worker(wid, MsgType.PREFILLED, request_id=b["request_id"], attempt=b["attempt"], token_id=token,
                           finish_reason=finish, descriptor={"kv_on": wid}, state=kv_state(b["request_id"]), **kw)

    def step(self, wid: str, stage_msg: ToWorker, tokens: list[int], finished: bool = False, **kw: Any) -> list:
        b = stage_msg.body
        item = {"request_id": b["request_id"], "attempt": b["attempt"], "token_ids": tokens, "finished": finished,
                **({"finish_reason": "length"} if finished else {}), **kw}
        return self.worker(wid, MsgType.STEP_TOKENS, items=[item])

    def client_rid(self, stage_msg: ToWorker) -> str:
        """The client's request_id of the request a stage message is about."""
        return self.m.requests[stage_msg.body["request_id"]].client_rid

    def failed(self, wid: str, stage_msg: ToWorker, retryable: bool = True) -> list:
        b = stage_msg.body
        return self.worker(wid, MsgType.FAILED, request_id=b["request_id"], attempt=b["attempt"],
                           message="engine exploded", retryable=retryable)


def only(out: list, kind: MsgType, to: str | bytes | None = None):
    """The one message of `kind` in `out` (to `to`, if given)."""
    hits = [m for m in out if m.kind is kind and to in (None, getattr(m, "worker_id", getattr(m, "identity", None)))]
    assert len(hits) == 1, f"expected one {kind.name} to {to}, got {out}"
    return hits[0]


def kinds(out: list) -> list[tuple[str, str | bytes]]:
    return [(m.kind.name, m.worker_id if isinstance(m, ToWorker) else m.identity) for m in out]


DISAGG = (("e0", "encode"), ("e1", "encode"), ("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))


# -- happy paths ----------------------------------------------------------------------------------------

def test_a_multi_image_encode_is_spread_over_idle_encoders_and_prefill_starts_with_the_first_part():
    h = Harness(*DISAGG)
    h.t = 1.0
    out = h.submit(make_admitted(images=3))
    assert kinds(out) == [("ENCODE", "e0"), ("ENCODE", "e1")]
    e0, e1 = out
    assert [im["hash"] for im in e0.body["images"]] == ["img-r1-0", "img-r1-2"]
    assert [im["hash"] for im in e1.body["images"]] == ["img-r1-1"]
    loads = h.m.status()["workers"]
    assert loads["e0"]["load"]["inflight"] == 1 and loads["e1"]["load"]["inflight"] == 1
    # e1's part is in: prefill starts now with it (the prompt runs up to image 0, its KV reserved)...
    h.t = 2.0
    pre = only(h.encoded("e1", e1), MsgType.PREFILL, "p0")
    assert pre.body["embedding_parts"] == [{"descriptor": {"from": "e1", "attempt": 0}, "images": [1],
                                            "grids": [[1, 2, 2]]}]
    assert pre.body["pending_images"] == [0, 2] and pre.body["image_tokens"] == [4, 4, 4]
    assert pre.body.get("embeddings") is None and pre.body["grids"] == [None, [1, 2, 2], None]
    loads = h.m.status()["workers"]
    assert loads["e1"]["load"]["inflight"] == 0 and loads["e0"]["load"]["inflight"] == 1  # e0 still encoding
    assert loads["p0"]["load"]["inflight"] == 1
    # ...and e0's part follows it there.
    h.t = 3.0
    more = only(h.encoded("e0", e0), MsgType.EMBEDDINGS, "p0")
    assert more.body == {"request_id": pre.body["request_id"], "attempt": 0,
                         "parts": [{"descriptor": {"from": "e0", "attempt": 0}, "images": [0, 2],
                                    "grids": [[1, 2, 2], [1, 2, 2]]}]}
    assert h.m.status()["workers"]["e0"]["load"]["inflight"] == 0
    dec = only(h.prefilled("p0", pre, token=5), MsgType.DECODE)
    out = h.step("d0", dec, [6], finished=True)
    res = only(out, MsgType.RESULT).body
    assert res["token_ids"] == [5, 6] and res["timings"]["encode_s"] == 2.0  # until the last part


def test_all_parts_in_before_a_prefill_worker_is_free_go_in_one_prefill():
    h = Harness(("e0", "encode"), ("e1", "encode"), ("p0", "prefill"), ("d0", "decode"), max_stages=1)
    busy = only(h.submit(make_admitted("t", images=0)), MsgType.PREFILL, "p0")  # p0 is full (cap 1)
    e0, e1 = h.submit(make_admitted(images=2))
    assert h.encoded("e0", e0) == [] and h.m.requests[e0.body["request_id"]].stage == Stage.QUEUED
    assert h.encoded("e1", e1) == []
    out = h.prefilled("p0", busy, token=1, finish="stop")
    pre = only(out, MsgType.PREFILL, "p0")
    assert [p["images"] for p in pre.body["embedding_parts"]] == [[0], [1]] and pre.body["pending_images"] == []


def test_a_spread_encode_reruns_when_a_part_encoder_dies_and_cancels_the_others():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(make_admitted(images=2))
    pre = only(h.encoded("e0", e0), MsgType.PREFILL, "p0")  # prefill started; e1 still encodes image 1
    out = h.advance(DEAD_AFTER + 1, beating=("e0", "p0", "p1", "d0", "d1"))  # e1 falls silent
    # Re-run on e0 alone (the only encoder left); the prefill and e0's parked part are cancelled first.
    assert kinds(out) == [("CANCEL", "e0"), ("CANCEL", "p0"), ("ENCODE", "e0")]
    rerun = out[2]
    assert rerun.body["attempt"] == 1 and len(rerun.body["images"]) == 2
    assert h.encoded("e1", e1) == []  # a late part of attempt 0 is stale
    assert h.prefilled("p0", pre, token=3) == []  # so is the cancelled prefill
    pre = only(h.encoded("e0", rerun), MsgType.PREFILL)
    assert pre.body["embeddings"] == {"from": "e0", "attempt": 1} and pre.body.get("embedding_parts") is None


def test_aborting_a_spread_encode_cancels_it_on_every_encoder():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(make_admitted(images=2))
    only(h.encoded("e1", e1), MsgType.PREFILL, "p0")  # one part in and prefilling, one still encoding
    out = h.m.abort(CLIENT, "r1", now=h.t)
    assert sorted(kinds(out)) == [("CANCEL", "e0"), ("CANCEL", "e1"), ("CANCEL", "p0"), ("ERROR", CLIENT)]
    loads = h.m.status()["workers"]
    assert loads["e0"]["load"]["inflight"] == 0 and loads["p0"]["load"]["inflight"] == 0


def test_spread_encode_off_keeps_a_request_on_one_encoder():
    h = Harness(*DISAGG)
    h.m.settings.spread_encode = False
    out = h.submit(make_admitted(images=2))
    assert kinds(out) == [("ENCODE", "e0")] and len(out[0].body["images"]) == 2


def test_disaggregated_happy_path_streams_and_ends_with_all_tokens():
    h = Harness(*DISAGG)
    out = h.submit(make_admitted(images=1, stream=True))
    assert kinds(out) == [("ENCODE", "e0")]
    enc = out[0]
    assert enc.body["attempt"] == 0 and [im["hash"] for im in enc.body["images"]] == ["img-r1-0"]
    assert h.m.status()["workers"]["e0"]["load"]["inflight"] == 1

    out = h.encoded("e0", enc, cache_hits=1)
    pre = only(out, MsgType.PREFILL)
    assert kinds(out) == [("PREFILL", "p0")]
    assert pre.body["embeddings"] == {"from": "e0", "attempt": 0} and pre.body["grids"] == [[1, 2, 2]]
    assert pre.body["output_ids"] == [] and pre.body["prompt_ids"] == list(range(100, 120))
    assert h.m.status()["workers"]["e0"]["load"]["inflight"] == 0

    out = h.prefilled("p0", pre, token=7)
    assert kinds(out) == [("TOKENS", CLIENT), ("DECODE", "d0")]
    # the first TOKENS also says how long the prompt was (a client stopping early still knows its usage)
    assert out[0].body == {"request_id": "r1", "index": 0, "token_ids": [7], "prompt_tokens": 20}
    dec = out[1]
    assert dec.body["descriptor"] == {"kv_on": "p0"} and dec.body["state"] == kv_state(pre.body["request_id"])

    out = h.step("d0", dec, [8, 9])
    assert kinds(out) == [("TOKENS", CLIENT)] and out[0].body["index"] == 1
    h.t += 1.0
    out = h.step("d0", dec, [10], finished=True)
    assert kinds(out) == [("TOKENS", CLIENT), ("RESULT", CLIENT)]
    res = out[1].body
    assert res["token_ids"] == [7, 8, 9, 10] and res["text"] == "7 8 9 10"
    assert res["finish_reason"] == "length" and res["attempts"] == 1 and res["prompt_tokens"] == 20
    assert res["visual_tokens"] == 4 and res["cache_hits"]["embedding"] == 1 and res["timings"]["total_s"] == 1.0
    status = h.m.status()
    assert status["requests_in_flight"] == 0 and status["stats"]["completed"] == 1
    assert all(w["load"]["inflight"] == 0 for w in status["workers"].values())


def test_a_prompt_lent_to_a_decode_worker_is_prefilled_and_decoded_there():
    h = Harness(("p0", "prefill"), ("d0", "decode"), local_prefill_tokens=20)
    first = only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")  # nothing waits at p0 yet
    lent = only(h.submit(make_admitted("b", stream=True)), MsgType.PREFILL, "d0")  # p0 has 20 prompt tokens waiting
    assert lent.body["prompt_ids"] == list(range(100, 120)) and h.m.status()["stats"]["local_prefills"] == 1
    assert h.m.members.get("d0").inflight_tokens == 20
    h.t += 0.5
    out = h.step("d0", lent, [7], first=True)  # no PREFILLED: its first token comes as a decode step's
    assert kinds(out) == [("TOKENS", CLIENT)] and h.m.requests[lent.body["request_id"]].stage == Stage.DECODE
    assert h.m.members.get("d0").inflight_tokens == 0  # its prompt is done there
    h.t += 1.0
    out = h.step("d0", lent, [8, 9], finished=True)
    res = only(out, MsgType.RESULT).body
    assert kinds(out) == [("TOKENS", CLIENT), ("RESULT", CLIENT)]
    assert res["token_ids"] == [7, 8, 9] and res["timings"]["prefill_s"] == 0.5 and res["timings"]["decode_s"] == 1.0
    # The first request went the usual way, and the next one finds p0 with nothing waiting again.
    only(h.prefilled("p0", first, token=5), MsgType.DECODE, "d0")
    assert only(h.submit(make_admitted("c")), MsgType.PREFILL, "p0")


def test_adaptive_lending_lends_to_an_idle_decode_worker_once_prompts_wait_at_prefill():
    h = Harness(("p0", "prefill"), ("d0", "decode"), adaptive_lending=True)
    only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")  # nothing waits at p0: nothing to save
    lent = only(h.submit(make_admitted("b", stream=True)), MsgType.PREFILL, "d0")  # 20 tokens wait at p0
    assert h.m.status()["stats"]["local_prefills"] == 1 and h.m.members.get("d0").inflight_tokens == 20
    # d0 now holds one request: a third prompt would save 20 - 20 = 0 tokens there, and cost it 20.
    only(h.submit(make_admitted("c")), MsgType.PREFILL, "p0")
    assert lent.body["prompt_ids"] == list(range(100, 120))


def test_a_lent_prompt_that_fails_reruns_and_a_stale_first_token_is_ignored():
    h = Harness(("p0", "prefill"), ("d0", "decode"), local_prefill_tokens=1)
    only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")
    lent = only(h.submit(make_admitted("b", stream=True)), MsgType.PREFILL, "d0")
    out = h.failed("d0", lent)
    assert kinds(out) == [("CANCEL", "d0"), ("PREFILL", "d0")]  # re-run: p0 still busy, so lent again
    assert h.step("d0", lent, [7], first=True) == []  # the failed attempt's token: stale
    rerun = out[1]
    assert rerun.body["attempt"] == 1
    assert kinds(h.step(rerun.worker_id, rerun, [7], first=True)) == [("TOKENS", CLIENT)]


def test_direct_tokens_leave_the_coordinator_out_of_the_stream():
    """token_report_every > 1: DECODE tells the worker where the client's token sink is; the coordinator
    relays the first token (from PREFILLED) and the RESULT only, and assigns a seed to sampling."""
    h = Harness(*DISAGG, token_report_every=16, seed=3)
    adm = make_admitted(stream=True)
    adm.request.tokens_to = "tcp://10.0.0.9:4000"
    adm.request.sampling.temperature = 0.7
    pre = only(h.submit(adm), MsgType.PREFILL)
    assert isinstance(pre.body["sampling"]["seed"], int)  # a re-run samples what the client already has
    out = h.prefilled("p0", pre, token=7)
    assert kinds(out) == [("TOKENS", CLIENT), ("DECODE", "d0")]
    dec = out[1]
    assert (dec.body["report_every"], dec.body["tokens_to"], dec.body["client_rid"]) == (16, "tcp://10.0.0.9:4000", "r1")
    assert h.step("d0", dec, list(range(20, 36))) == []  # the worker streamed them to the client itself
    out = h.step("d0", dec, [36], finished=True)
    assert kinds(out) == [("RESULT", CLIENT)] and out[0].body["token_ids"] == [7, *range(20, 37)]
    assert h.m.status()["stats"]["token_items"] == 2

    # A client without a sink (or a request that does not stream) still gets its tokens relayed.
    plain = make_admitted("r2", stream=True)
    pre = only(h.submit(plain), MsgType.PREFILL)
    assert plain.request.sampling.seed is None  # greedy: nothing to seed
    dec = h.prefilled("p0", pre, token=1)[1]
    assert (dec.body["report_every"], dec.body.get("tokens_to")) == (16, None)
    assert kinds(h.step("d0", dec, [2, 3])) == [("TOKENS", CLIENT)]


def test_unified_route_when_only_unified_workers_exist():
    h = Harness(("u0", "unified"), ("u1", "unified"))
    out = h.submit(make_admitted(images=1))
    run = only(out, MsgType.RUN, "u0")
    assert run.body["images"][0]["hash"] == "img-r1-0" and run.body["output_ids"] == []
    assert h.step("u0", run, [1, 2], first=True) == []  # not streaming: nothing until the end
    out = h.step("u0", run, [3], finished=True)
    assert kinds(out) == [("RESULT", CLIENT)]
    assert out[0].body["token_ids"] == [1, 2, 3] and out[0].body["attempts"] == 1


def test_text_only_requests_skip_encode_and_image_requests_wait_for_an_encoder():
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    assert kinds(h.submit(make_admitted("text"))) == [("PREFILL", "p0")]
    assert h.submit(make_admitted("pic", images=1)) == []  # parked: no encode pool yet
    out = h.join("e0", "encode")
    assert kinds(out) == [("ENCODE", "e0")]  # a joining worker picks up parked requests


def test_prefill_that_finishes_the_request_ends_it_without_decode():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted()), MsgType.PREFILL)
    out = h.prefilled("p0", pre, token=3, finish="stop")
    assert kinds(out) == [("RESULT", CLIENT)] and out[0].body["token_ids"] == [3]


# -- re-runs ----------------------------------------------------------------------------------------------

def test_retryable_failure_reruns_on_another_worker_and_stale_replies_are_ignored():
    h = Harness(*DISAGG)
    pre0 = only(h.submit(make_admitted()), MsgType.PREFILL, "p0")
    h.worker("p0", MsgType.HEARTBEAT, worker_id="p0", load={"queue_len": 5})  # p0 is now the busier one
    out = h.failed("p0", pre0)
    assert kinds(out) == [("CANCEL", "p0"), ("PREFILL", "p1")]
    pre1 = out[1]
    assert pre1.body["attempt"] == 1 and pre1.body["request_id"] == pre0.body["request_id"]
    # Late replies of attempt 0 (from p0, or claiming p1) and replies of the wrong stage change nothing.
    assert h.prefilled("p0", pre0, token=99) == []
    assert h.prefilled("p1", pre0, token=99) == []
    assert h.step("p1", pre1, [99]) == []
    assert h.failed("p0", pre0) == []
    out = h.prefilled("p1", pre1, token=4)
    dec = only(out, MsgType.DECODE)
    out = h.step(dec.worker_id, dec, [5], finished=True)
    res = only(out, MsgType.RESULT).body
    assert res["token_ids"] == [4, 5] and res["attempts"] == 2
    assert h.m.stats["reruns"] == 1


def test_non_retryable_failure_ends_with_bad_request():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted()), MsgType.PREFILL)
    out = h.failed("p0", pre, retryable=False)
    assert kinds(out) == [("ERROR", CLIENT)]
    assert out[0].body == {"request_id": "r1", "code": ErrorCode.BAD_REQUEST, "message": "engine exploded"}
    assert h.m.status()["requests_in_flight"] == 0


def test_max_attempts_gives_up_with_internal():
    h = Harness(*DISAGG, max_attempts=3)
    msg = only(h.submit(make_admitted()), MsgType.PREFILL)
    for attempt in (1, 2):
        msg = only(h.failed(msg.worker_id, msg), MsgType.PREFILL)
        assert msg.body["attempt"] == attempt
    out = h.failed(msg.worker_id, msg)
    err = only(out, MsgType.ERROR, CLIENT).body
    assert err["code"] == ErrorCode.INTERNAL and "gave up after 3 attempts" in err["message"]
    assert not [m for m in out if m.kind in (MsgType.PREFILL, MsgType.ENCODE, MsgType.RUN)]
    assert h.m.stats["failed"] == 1 and h.m.status()["requests_in_flight"] == 0


def test_stage_deadline_reruns_the_request():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted()), MsgType.PREFILL, "p0")
    assert h.advance(TIMEOUT - 0.1, beating=("p0", "p1", "d0", "d1", "e0", "e1")) == []
    out = h.advance(0.2, beating=("p0", "p1", "d0", "d1", "e0", "e1"))
    assert kinds(out) == [("CANCEL", "p0"), ("PREFILL", "p0")]  # p0 is alive, just slow: stopped, then re-sent
    assert out[1].body["attempt"] == 1
    assert h.prefilled("p0", pre, token=1) == []  # the timed-out attempt's answer is stale now


def test_a_request_merely_queued_at_a_busy_worker_is_never_rerun():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted()), MsgType.PREFILL, "p0")
    rid = pre.body["request_id"]
    for _ in range(3):  # three stage timeouts long, p0 reports the request waiting in its queue
        h.worker("p0", MsgType.HEARTBEAT, worker_id="p0", load={"queued": [rid], "queue_len": 1})
        assert h.advance(TIMEOUT * 0.9, beating=("p0", "p1", "d0", "d1", "e0", "e1")) == []
        h.worker("p0", MsgType.HEARTBEAT, worker_id="p0", load={"queued": [rid], "queue_len": 1})
    h.worker("p0", MsgType.HEARTBEAT, worker_id="p0", load={"queued": [], "queue_len": 0})  # it started there
    out = h.advance(TIMEOUT + 0.1, beating=("p0", "p1", "d0", "d1", "e0", "e1"))
    assert kinds(out) == [("CANCEL", "p0"), ("PREFILL", "p0")]  # running past the timeout: re-run


def test_decode_progress_resets_the_stage_deadline():
    h = Harness(("u0", "unified"))
    run = only(h.submit(make_admitted()), MsgType.RUN)
    for _ in range(3):
        assert h.advance(TIMEOUT * 0.8, beating=("u0",)) == []
        assert h.step("u0", run, [1]) == []
    assert kinds(h.advance(TIMEOUT + 0.1, beating=("u0",))) == [("CANCEL", "u0"), ("RUN", "u0")]


def test_parked_request_past_the_stage_timeout_fails_with_no_workers():
    h = Harness()
    assert h.submit(make_admitted()) == []
    assert h.advance(TIMEOUT - 0.1) == []
    out = h.advance(0.2)
    assert kinds(out) == [("ERROR", CLIENT)] and out[0].body["code"] == ErrorCode.NO_WORKERS
    assert "start stage" in out[0].body["message"]
    assert h.join("u0", "unified") == []  # it is over: nothing left to dispatch


def test_silent_worker_is_declared_dead_its_requests_rerun_and_it_gets_cancel_on_rejoin():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted(stream=True)), MsgType.PREFILL, "p0")
    dec = only(h.prefilled("p0", pre, token=5), MsgType.DECODE, "d0")
    h.step("d0", dec, [6])
    others = ("e0", "e1", "p0", "p1", "d1")
    out = h.advance(DEAD_AFTER + 0.5, beating=others)
    assert kinds(out) == [("PREFILL", "p0")]  # no CANCEL to d0: it is dead
    rerun = out[0]
    assert rerun.body["attempt"] == 1 and rerun.body["output_ids"] == [5, 6]
    assert h.m.status()["workers"]["d0"]["alive"] is False
    dec1 = only(h.prefilled("p0", rerun, token=7), MsgType.DECODE, "d1")
    assert h.step("d0", dec, [66]) == []  # the stalled worker wakes up: its tokens are stale
    out = h.join("d0", "decode", kind=MsgType.HEARTBEAT)  # and rejoins through its heartbeat
    assert kinds(out) == [("CANCEL", "d0")] and out[0].body == {"request_id": pre.body["request_id"]}
    assert h.m.status()["workers"]["d0"]["alive"] is True
    assert h.join("d0", "decode", kind=MsgType.HEARTBEAT) == []  # only once
    res = only(h.step("d1", dec1, [8], finished=True), MsgType.RESULT).body
    assert res["token_ids"] == [5, 6, 7, 8] and res["attempts"] == 2


def test_streamed_tokens_are_not_duplicated_across_a_rerun():
    h = Harness(*DISAGG)
    client_msgs = []
    pre = only(h.submit(make_admitted(stream=True, max_tokens=32)), MsgType.PREFILL)
    out = h.prefilled(pre.worker_id, pre, token=1)
    client_msgs += out
    dec = only(out, MsgType.DECODE)
    client_msgs += h.step(dec.worker_id, dec, [2, 3])
    out = h.worker(dec.worker_id, MsgType.BYE, worker_id=dec.worker_id)  # the decode worker leaves
    pre1 = only(out, MsgType.PREFILL)
    assert pre1.body["output_ids"] == [1, 2, 3] and pre1.body["attempt"] == 1
    out = h.prefilled(pre1.worker_id, pre1, token=4)  # the new attempt continues after the streamed tokens
    client_msgs += out
    dec1 = only(out, MsgType.DECODE)
    assert dec1.worker_id != dec.worker_id
    client_msgs += h.step(dec1.worker_id, dec1, [5, 6], finished=True)
    streamed, result = [], None
    for m in client_msgs:
        if isinstance(m, ToClient) and m.kind is MsgType.TOKENS:
            assert m.body["index"] == len(streamed)
            streamed += m.body["token_ids"]
        elif isinstance(m, ToClient) and m.kind is MsgType.RESULT:
            result = m.body
    assert streamed == result["token_ids"] == [1, 2, 3, 4, 5, 6]


def test_death_of_the_encoder_holding_the_embeddings_reruns_a_request_in_prefill():
    h = Harness(*DISAGG)
    enc = only(h.submit(make_admitted(images=1)), MsgType.ENCODE, "e0")
    pre = only(h.encoded("e0", enc), MsgType.PREFILL, "p0")
    out = h.m.worker_unreachable("e0", "Host unreachable", now=h.t)  # the prefill worker cannot fetch anymore
    assert kinds(out) == [("CANCEL", "p0"), ("ENCODE", "e1")]
    assert out[1].body["attempt"] == 1
    assert h.prefilled("p0", pre, token=1) == []


def test_death_of_the_encoder_reruns_a_request_parked_for_prefill():
    h = Harness(("e0", "encode"), ("e1", "encode"), ("p0", "prefill"), ("d0", "decode"))
    enc = only(h.submit(make_admitted(images=1)), MsgType.ENCODE, "e0")
    assert h.worker("p0", MsgType.BYE, worker_id="p0") == []  # nothing of it on p0 yet
    assert h.encoded("e0", enc) == []  # encoded, parked: no prefill worker
    assert h.worker("e0", MsgType.BYE, worker_id="e0") == []  # its embeddings are gone with e0
    out = h.join("p1", "prefill")
    assert kinds(out) == [("ENCODE", "e1")]  # re-encoded, not prefilled from lost embeddings
    assert out[0].body["attempt"] == 1


def test_death_of_the_prefill_worker_holding_the_kv_reruns_a_request_parked_for_decode():
    h = Harness(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    pre = only(h.submit(make_admitted()), MsgType.PREFILL, "p0")
    assert h.worker("d0", MsgType.BYE, worker_id="d0") == []
    assert h.prefilled("p0", pre, token=1) == []  # parked for decode, its KV on p0
    assert h.worker("p0", MsgType.BYE, worker_id="p0") == []  # no decode pool: the re-run parks too
    out = h.join("d1", "decode")
    pre1 = only(out, MsgType.PREFILL, "p1")
    assert pre1.body["attempt"] == 1 and pre1.body["output_ids"] == [1]


def test_unreachable_worker_is_dead_and_its_stage_reruns():
    h = Harness(("u0", "unified"), ("u1", "unified"))
    run = only(h.submit(make_admitted()), MsgType.RUN, "u0")
    out = h.m.worker_unreachable("u0", "Host unreachable", now=h.t)
    assert kinds(out) == [("RUN", "u1")] and out[0].body["attempt"] == 1
    assert h.m.worker_unreachable("u0", "again", now=h.t) == []  # already dead
    assert h.step("u0", run, [1], finished=True) == []


def test_sends_that_never_reached_a_worker_do_not_use_up_attempts():
    """A dead host's workers are found one send at a time; those attempts never ran."""
    h = Harness(("u0", "unified"), ("u1", "unified"), ("u2", "unified"), ("u3", "unified"), max_attempts=2)
    run = only(h.submit(make_admitted()), MsgType.RUN, "u0")
    rid = run.body["request_id"]
    out = h.m.worker_unreachable("u0", "Host unreachable", rid, now=h.t)
    run = only(out, MsgType.RUN, "u1")
    run = only(h.m.worker_unreachable("u1", "Host unreachable", rid, now=h.t), MsgType.RUN, "u2")
    assert run.body["attempt"] == 2  # two re-runs, neither counted: max_attempts=2 is not reached
    # A worker that dies while running it (not a failed send) does use up an attempt.
    out = h.m.worker_unreachable("u2", "Host unreachable", now=h.t)
    run = only(out, MsgType.RUN, "u3")
    out = h.m.worker_unreachable("u3", "Host unreachable", now=h.t)
    errors = [o for o in out if o.kind == MsgType.ERROR]
    assert len(errors) == 1 and "gave up after 4 attempts (2 never reached a worker)" in errors[0].body["message"]


def test_reregistering_worker_loses_its_work():
    h = Harness(("u0", "unified"))
    only(h.submit(make_admitted()), MsgType.RUN, "u0")
    out = h.join("u0", "unified")  # same id, a restarted process
    assert kinds(out) == [("CANCEL", "u0"), ("RUN", "u0")]  # CANCEL of the abandoned work, then the re-run
    assert out[1].body["attempt"] == 1


# -- clients ---------------------------------------------------------------------------------------------

def test_abort_cancels_on_the_worker_and_answers_aborted():
    h = Harness(*DISAGG)
    pre = only(h.submit(make_admitted()), MsgType.PREFILL, "p0")
    out = h.m.abort(CLIENT, "r1", now=h.t)
    assert kinds(out) == [("CANCEL", "p0"), ("ERROR", CLIENT)]
    assert out[0].body == {"request_id": pre.body["request_id"]} and out[1].body["code"] == ErrorCode.ABORTED
    assert h.prefilled("p0", pre, token=1) == []
    assert h.m.abort(CLIENT, "r1", now=h.t) == []
    assert h.m.status()["workers"]["p0"]["load"]["inflight"] == 0
    assert h.m.stats["completed"] == 0 and h.m.stats["failed"] == 1


def test_duplicate_request_id_is_refused_while_in_flight_and_reject_counts():
    h = Harness(("u0", "unified"))
    only(h.submit(make_admitted()), MsgType.RUN)
    out = h.submit(make_admitted())
    assert kinds(out) == [("ERROR", CLIENT)] and out[0].body["code"] == ErrorCode.BAD_REQUEST
    assert "already in flight" in out[0].body["message"]
    out = h.m.reject(CLIENT, "bad", "max_tokens too big", now=h.t)
    assert out == [ToClient(CLIENT, Error(request_id="bad", code=ErrorCode.BAD_REQUEST, message="max_tokens too big"))]
    assert h.m.stats["admitted"] == 1 and h.m.stats["rejected"] == 1


def test_unregistered_and_unknown_role_workers_are_ignored():
    h = Harness()
    assert h.worker("ghost", MsgType.STEP_TOKENS, items=[{"request_id": "x", "attempt": 0, "token_ids": [1]}]) == []
    assert h.join("odd", "painter") == []
    assert h.m.status()["workers"] == {}


def test_routing_charges_in_flight_load_and_prefers_the_embedding_holder():
    h = Harness(*DISAGG)
    enc = only(h.submit(make_admitted("a", images=1)), MsgType.ENCODE, "e0")
    assert only(h.submit(make_admitted("b", images=1)), MsgType.ENCODE).worker_id == "e1"  # e0 has one in flight
    h.encoded("e0", enc)
    # A new request with the same image goes back to e0, which holds it, though both are equally busy now.
    adm = make_admitted("c", images=1)
    adm.images[0].hash = "img-a-0"
    assert only(h.submit(adm), MsgType.ENCODE).worker_id == "e0"
    assert Stage.PREFILL == "prefill" and f"{Stage.QUEUED}" == "queued"


def test_route_choices_spread_shards_that_see_the_same_loads():
    """Two shards (two machines) over the same idle prefill pool: scoring every worker, both send their
    next request to the same one; drawing two at random they mostly do not."""
    pool = [(f"p{i}", "prefill") for i in range(6)] + [("d0", "decode")]

    def first_pick(seed: int | None, choices: int) -> str:
        h = Harness(*pool, route_choices=choices, seed=seed)
        return only(h.submit(make_admitted("a")), MsgType.PREFILL).worker_id

    assert {first_pick(None, 0) for _ in range(5)} == {"p0"}  # herding: every shard's "least busy" is p0
    pairs = [(first_pick(2 * i, 2), first_pick(2 * i + 1, 2)) for i in range(20)]
    assert sum(a != b for a, b in pairs) >= 8, pairs
    assert len({w for pair in pairs for w in pair}) >= 4


def test_route_choices_never_trade_away_cache_affinity():
    """The encoder holding a request's image is always among the choices, whatever the draw."""
    pool = [(f"e{i}", "encode") for i in range(6)] + [("p0", "prefill"), ("d0", "decode")]
    for seed in range(10):
        h = Harness(*pool, route_choices=2, seed=seed)
        h.m.members.add_holder("img-a-0", "e5")
        assert only(h.submit(make_admitted("a", images=1)), MsgType.ENCODE).worker_id == "e5"


def test_route_choices_of_one_is_refused():
    from pydantic import ValidationError

    from mserve.coordinator.settings import CoordinatorSettings

    with pytest.raises(ValidationError, match="at least 2"):
        CoordinatorSettings(model="m", route_choices=1)
    assert CoordinatorSettings(model="m", route_choices=2).route_choices == 2


@pytest.mark.parametrize("dead_role", ["decode", "unified"])
def test_heartbeats_keep_workers_alive(dead_role):
    h = Harness(("w0", dead_role))
    assert h.advance(DEAD_AFTER * 3, beating=("w0",)) == []
    assert h.m.status()["workers"]["w0"]["alive"] is True
    h.advance(DEAD_AFTER + 0.1)
    assert h.m.status()["workers"]["w0"]["alive"] is False and h.m.status()["roles"] == {}


def test_an_older_load_report_never_overwrites_a_newer_one():
    """A heartbeat and the Redis copy of an earlier one can arrive out of order (a flaky test's cause:
    a busy decode worker looked idle for one Redis sync)."""
    h = Harness()
    h.join("d0", "decode", running=0, free_blocks=1000, at=100.0)
    h.worker("d0", MsgType.HEARTBEAT, worker_id="d0", load={"running": 1, "free_blocks": 990, "at": 101.0})
    h.m.apply_loads({"d0": {"running": 0, "free_blocks": 1000, "at": 100.0}})  # Redis, one report behind
    load = h.m.status()["workers"]["d0"]["load"]
    assert (load["running"], load["free_blocks"]) == (1, 990)
    h.m.apply_loads({"d0": {"running": 0, "free_blocks": 1000, "at": 102.0}})
    assert h.m.status()["workers"]["d0"]["load"]["running"] == 0


def test_shedding_turns_away_the_lowest_class_with_an_explicit_overloaded_error():
    h = Harness(*DISAGG, max_waiting=3)
    sent = {}
    for rid, pri, cls in [("b-old", 0, "batch"), ("i-1", 0, "interactive"), ("b-new", 0, "batch")]:
        sent[rid] = only(h.submit(make_admitted(rid, priority=pri, latency_class=cls)), MsgType.PREFILL)
        h.t += 0.1
    # Full. Another batch request is the lowest class itself (newest of the lowest): it is refused.
    out = h.submit(make_admitted("b-late", latency_class="batch"))
    assert kinds(out) == [("ERROR", CLIENT)]
    err = out[0].body
    assert err["code"] == ErrorCode.OVERLOADED and err["request_id"] == "b-late" and err["retry_after_s"] > 0
    assert "max_waiting_requests=3" in err["message"]
    # An interactive request displaces the newest batch one, which is cancelled on its worker and told why.
    out = h.submit(make_admitted("i-2"))
    assert [m.kind for m in out] == [MsgType.CANCEL, MsgType.ERROR, MsgType.PREFILL]
    assert out[0].body["request_id"] == sent["b-new"].body["request_id"]
    assert out[1].body["request_id"] == "b-new" and out[1].body["code"] == ErrorCode.OVERLOADED
    # Higher priority beats class: a priority-1 batch request displaces the remaining batch one.
    out = h.submit(make_admitted("b-vip", priority=1, latency_class="batch"))
    assert [(m.kind, m.body["request_id"]) for m in out if m.kind is MsgType.ERROR] == [(MsgType.ERROR, "b-old")]
    assert h.m.stats["shed"] == 3 and len(h.m.requests) == 3
    # A request that has its first token no longer counts against the bound.
    h.prefilled(out[-1].worker_id, out[-1], token=1)
    assert only(h.submit(make_admitted("i-3")), MsgType.PREFILL)


def test_a_restarted_coordinator_knows_none_of_the_old_requests_and_frees_their_workers():
    """After a restart the client's probe learns which of its requests are gone; a worker still decoding
    one of them is told to drop it."""
    h = Harness(("u0", "unified"))
    run = only(h.submit(make_admitted("r1")), MsgType.RUN)
    assert h.m.unknown(CLIENT, ["r1", "r9"]) == ["r9"]
    assert h.m.unknown(b"other-client", ["r1"]) == ["r1"]  # ids are per client

    fresh = Harness(("u0", "unified"))  # the coordinator that replaced the first one
    assert fresh.m.unknown(CLIENT, ["r1"]) == ["r1"]
    out = fresh.step("u0", run, [5, 6])
    assert kinds(out) == [("CANCEL", "u0")] and out[0].body == {"request_id": run.body["request_id"]}
    assert fresh.step("u0", run, [7], finished=True) == []  # already over there: nothing to cancel


def test_a_draining_flag_read_from_redis_does_not_stop_routing():
    """Only a worker's own heartbeat says it drains: Redis may hold another process's load under its id."""
    h = Harness(("u0", "unified"))
    h.m.apply_loads({"u0": {"draining": True, "queue_len": 0, "at": 1e12}})
    assert kinds(h.submit(make_admitted())) == [("RUN", "u0")]


def test_a_draining_worker_gets_nothing_new_and_one_shutdown_once_its_work_is_done():
    h = Harness(("u0", "unified"), ("u1", "unified"))
    run = only(h.submit(make_admitted("a")), MsgType.RUN, "u0")
    h.worker("u0", MsgType.HEARTBEAT, worker_id="u0", load={"draining": True})
    assert h.m.status()["workers"]["u0"]["draining"] is True
    assert kinds(h.submit(make_admitted("b"))) == [("RUN", "u1")]  # u0 is busy with "a" and drains
    assert h.advance(0.1, beating=("u0", "u1")) == []  # "a" still runs on u0: no SHUTDOWN yet
    assert kinds(h.step("u0", run, [5], finished=True)) == [("RESULT", CLIENT)]
    assert kinds(h.advance(0.1, beating=("u0", "u1"))) == [("SHUTDOWN", "u0")]
    assert h.advance(1.0, beating=("u0", "u1")) == []  # sent once
    h.join("u0", "unified")  # a new process under the same id: routable, and drains only when it says so
    assert h.m.status()["workers"]["u0"]["draining"] is False
    assert kinds(h.submit(make_admitted("c"))) == [("RUN", "u0")]


# -- late binding: stages wait at the coordinator, in class order, beyond max_stages_per_worker ---------------

def test_with_a_cap_a_later_interactive_request_overtakes_a_waiting_batch_one():
    h = Harness(("p0", "prefill"), ("d0", "decode"), max_stages=1)
    first = only(h.submit(make_admitted("first")), MsgType.PREFILL, "p0")
    h.t = 1.0
    assert h.submit(make_admitted("batch", latency_class="batch")) == []  # p0 has its one stage: it waits here
    h.t = 2.0
    assert h.submit(make_admitted("inter")) == []
    status = h.m.status()
    assert status["queued"] == {"prefill": {"interactive": 1, "batch": 1}}
    assert status["workers"]["p0"]["load"]["inflight"] == 1
    h.t = 3.0
    out = h.prefilled("p0", first, token=1, finish="stop")  # p0 frees: the interactive one goes first
    assert kinds(out) == [("RESULT", CLIENT), ("PREFILL", "p0")] and h.client_rid(out[1]) == "inter"
    h.t = 4.0
    out = h.prefilled("p0", out[1], token=2, finish="stop")
    assert kinds(out) == [("RESULT", CLIENT), ("PREFILL", "p0")] and h.client_rid(out[1]) == "batch"
    assert h.m.status()["queued"] == {}
    res = only(h.prefilled("p0", out[1], token=3, finish="stop"), MsgType.RESULT).body
    assert res["request_id"] == "batch" and res["timings"]["queue_s"] == 3.0  # waited at the coordinator 1.0 -> 4.0


def test_with_a_cap_a_waiting_request_binds_to_whichever_worker_frees_first():
    h = Harness(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), max_stages=1)
    only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")
    b = only(h.submit(make_admitted("b")), MsgType.PREFILL, "p1")
    assert h.submit(make_admitted("c")) == []  # not bound early to p0 (the one routing would pick now)
    out = h.prefilled("p1", b, token=1)  # p1 finishes first
    assert kinds(out) == [("DECODE", "d0"), ("PREFILL", "p1")] and h.client_rid(out[1]) == "c"
    assert {w: s["load"]["inflight"] for w, s in h.m.status()["workers"].items()} == {"p0": 1, "p1": 1, "d0": 1}


def test_the_cap_counts_open_stages_per_worker_and_leaves_decode_uncapped():
    h = Harness(("e0", "encode"), ("p0", "prefill"), ("d0", "decode"), max_stages=2)
    encs = [only(h.submit(make_admitted(f"img{i}", images=1)), MsgType.ENCODE, "e0") for i in range(2)]
    assert h.submit(make_admitted("img2", images=1)) == []
    assert h.m.status()["queued"] == {"encode": {"interactive": 1}}
    out = h.encoded("e0", encs[0])  # e0 has room again: img2's encode goes out after img0's prefill
    assert kinds(out) == [("PREFILL", "p0"), ("ENCODE", "e0")] and [h.client_rid(m) for m in out] == ["img0", "img2"]
    pre0, enc2 = out
    pre1 = only(h.encoded("e0", encs[1]), MsgType.PREFILL, "p0")
    assert h.encoded("e0", enc2) == []  # p0 has its two: img2's prefill waits
    assert h.m.status()["queued"] == {"prefill": {"interactive": 1}}
    out = h.prefilled("p0", pre0, token=1)
    assert kinds(out) == [("DECODE", "d0"), ("PREFILL", "p0")]
    only(h.prefilled("p0", pre1, token=1), MsgType.DECODE, "d0")
    only(h.prefilled("p0", out[1], token=1), MsgType.DECODE, "d0")
    assert h.m.status()["workers"]["d0"]["load"]["inflight"] == 3  # decode is not capped


def test_a_request_waiting_behind_busy_live_workers_is_neither_failed_nor_rerun_past_the_stage_timeout():
    """p0 keeps finishing stages, and each time an interactive request is there before the batch one
    (aging off): the batch one waits at the coordinator for over twice the stage timeout, untouched."""
    h = Harness(("p0", "prefill"), ("d0", "decode"), max_stages=1, aging=1000.0)
    cur = only(h.submit(make_admitted("i0")), MsgType.PREFILL, "p0")
    assert h.submit(make_admitted("b", latency_class="batch")) == []
    for k in range(1, 7):  # 6 x 2 s = 12 s > 2 x TIMEOUT
        assert h.submit(make_admitted(f"i{k}")) == []
        assert h.advance(2.0, beating=("p0", "d0")) == []
        out = h.prefilled("p0", cur, token=k, finish="stop")
        cur = only(out, MsgType.PREFILL, "p0")
        assert h.client_rid(cur) == f"i{k}" and cur.body["attempt"] == 0
    assert h.m.status()["queued"] == {"prefill": {"batch": 1}}
    assert h.m.stats["reruns"] == 0 and h.m.stats["failed"] == 0
    b = only(h.prefilled("p0", cur, token=9, finish="stop"), MsgType.PREFILL, "p0")
    assert h.client_rid(b) == "b" and b.body["attempt"] == 0
    res = only(h.prefilled("p0", b, token=1, finish="stop"), MsgType.RESULT).body
    assert res["request_id"] == "b" and res["attempts"] == 1 and res["timings"]["queue_s"] == 12.0


def test_a_waiting_request_ages_past_the_classes_behind_it():
    h = Harness(("p0", "prefill"), ("d0", "decode"), max_stages=1, aging=3.0)
    cur = only(h.submit(make_admitted("i0")), MsgType.PREFILL, "p0")
    assert h.submit(make_admitted("b", latency_class="batch")) == []
    h.t = 2.0
    assert h.submit(make_admitted("i1")) == []
    h.t = 3.5  # b has waited 3.5 s > 3 s: it goes before the interactive i1
    b = only(h.prefilled("p0", cur, token=1, finish="stop"), MsgType.PREFILL, "p0")
    assert h.client_rid(b) == "b"


def test_a_waiting_request_fails_a_stage_timeout_after_the_last_worker_of_its_role_is_gone():
    h = Harness(("p0", "prefill"), ("d0", "decode"), max_stages=1)
    only(h.submit(make_admitted("a")), MsgType.PREFILL, "p0")
    assert h.submit(make_admitted("b")) == []
    for _ in range(2):  # long past the stage timeout behind busy p0, which heartbeats and reports "a" queued
        h.worker("p0", MsgType.HEARTBEAT, worker_id="p0", load={"queued": [h.m.requests.find(CLIENT, "a").rid]})
        assert h.advance(TIMEOUT * 0.9, beating=("p0", "d0")) == []
    assert h.worker("p0", MsgType.BYE, worker_id="p0") == []  # "a" re-runs: both wait, no prefill pool left
    assert h.advance(TIMEOUT - 0.1, beating=("d0",)) == []  # a full stage timeout from then on
    out = h.advance(0.2, beating=("d0",))
    assert sorted(m.body["request_id"] for m in out if m.kind is MsgType.ERROR) == ["a", "b"]
    assert all(m.body["code"] == ErrorCode.NO_WORKERS for m in out)
    assert h.m.status()["queued"] == {} and h.m.status()["requests_in_flight"] == 0


def test_with_no_cap_stages_are_sent_at_once_and_nothing_waits_at_the_coordinator():
    h = Harness(("p0", "prefill"), ("d0", "decode"))
    sent = [only(h.submit(make_admitted(f"r{i}", latency_class="batch" if i % 2 else "interactive")),
                 MsgType.PREFILL, "p0") for i in range(4)]
    assert [h.client_rid(m) for m in sent] == ["r0", "r1", "r2", "r3"]
    assert h.m.status()["queued"] == {} and h.m.status()["workers"]["p0"]["load"]["inflight"] == 4


def test_a_bad_image_in_one_part_ends_the_request_and_cancels_the_other_parts():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(make_admitted(images=2))
    out = h.failed("e1", e1, retryable=False)  # e1's image cannot be decoded
    assert kinds(out) == [("CANCEL", "e0"), ("ERROR", CLIENT)]
    assert h.m.status()["workers"]["e0"]["load"]["inflight"] == 0 and not h.m.requests


def test_a_retryable_failure_of_one_part_reruns_the_request():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(make_admitted(images=2))
    out = h.failed("e1", e1)  # e1's part failed (say, out of memory): the whole request is re-run
    assert [k for k in kinds(out) if k[0] == "CANCEL"] == [("CANCEL", "e0"), ("CANCEL", "e1")]
    reruns = [m for m in out if m.kind is MsgType.ENCODE]
    assert reruns and all(m.body["attempt"] == 1 for m in reruns)


def test_a_part_still_encoding_after_prefill_started_can_fail_the_request():
    h = Harness(*DISAGG)
    e0, e1 = h.submit(make_admitted(images=2))
    only(h.encoded("e1", e1), MsgType.PREFILL, "p0")  # prefill started with e1's part; e0 still encodes
    out = h.failed("e0", e0, retryable=False)
    assert kinds(out) == [("CANCEL", "e1"), ("CANCEL", "p0"), ("ERROR", CLIENT)]


# -- images the cached prefix holds -------------------------------------------------------------------

class PrefixHits(NoLookups):
    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits

    def embedding_holders(self, image_hash: str) -> set[str]:
        return set()

    def prefix_hits(self, admitted: Admitted, block_size: int, sent_since: float | None = None) -> dict[str, int]:
        return self.hits


def two_images_ending_at_20_and_50() -> Admitted:
    adm = make_admitted("skip", images=2, prompt_len=80)
    for im, end in zip(adm.images, (20, 50)):
        im.end, im.skippable = end, True
    return adm


def test_images_in_the_prefill_workers_cached_prefix_are_not_encoded_and_prefill_goes_there():
    h = Harness(*DISAGG, lookups=PrefixHits({"p1": 2}))  # 32 tokens held on p1: the first image only
    out = h.submit(two_images_ending_at_20_and_50())
    enc = only(out, MsgType.ENCODE)
    assert [im["hash"] for im in enc.body["images"]] == ["img-skip-1"]
    pre = only(h.encoded(enc.worker_id, enc), MsgType.PREFILL)
    assert pre.worker_id == "p1" and pre.body["skipped_images"] == [0] and pre.body["image_tokens"] == [4, 4]
    assert [p["images"] for p in pre.body["embedding_parts"]] == [[1]]
    dec = only(h.prefilled("p1", pre, 7, skipped_images=1), MsgType.DECODE)
    res = only(h.step(dec.worker_id, dec, [8], finished=True), MsgType.RESULT)
    assert res.body["cache_hits"]["skipped_by_prefix"] == 1 and h.m.stats["encodes_skipped_by_prefix"] == 1


def test_every_image_held_skips_encode_and_a_prefill_without_the_blocks_reruns_with_every_image_encoded():
    h = Harness(*DISAGG, lookups=PrefixHits({"p0": 4}))  # 64 tokens held on p0: both images
    h.m.settings.spread_encode = False  # the re-run's one ENCODE carries both images (not spread over e0, e1)
    pre = only(h.submit(two_images_ending_at_20_and_50()), MsgType.PREFILL)
    assert pre.worker_id == "p0" and pre.body["skipped_images"] == [0, 1] and not pre.body.get("embeddings")
    # p0 evicted the blocks meanwhile: it fails the attempt, retryable; the re-run encodes both images.
    enc = only(h.failed("p0", pre), MsgType.ENCODE)
    assert [im["hash"] for im in enc.body["images"]] == ["img-skip-0", "img-skip-1"] and enc.body["attempt"] == 1
    pre = only(h.encoded(enc.worker_id, enc), MsgType.PREFILL)
    assert pre.body["skipped_images"] == [] and pre.body["embeddings"] is not None
