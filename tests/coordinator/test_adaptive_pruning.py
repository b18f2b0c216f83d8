"""SLO-adaptive pruning at the coordinator (coordinator/adaptive_pruning.py): settings, the prediction fed
from the machine's own records on tick, and the admission-side decision (counts, hashes, ENCODE, RESULT)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mserve.common.prompt import PromptBuilder
from mserve.common.protocol import MsgType
from mserve.common.pruning import kept_tokens, pruned_hash
from mserve.coordinator.adaptive_pruning import AdaptivePruning, objectives, parse_per_class, queued_work
from mserve.coordinator.admission import Limits, admit
from mserve.coordinator.pruning_policy import ClassObjective
from mserve.coordinator.settings import CoordinatorSettings
from tests.coordinator.test_request_machine import DISAGG, Harness, make_admitted, only
from tests.helpers import make_image


def test_settings_parse_per_class_and_refuse_naming_the_setting():
    assert parse_per_class("interactive=0.5, batch=0.25", "adaptive_pruning") == {"interactive": 0.5, "batch": 0.25}
    assert parse_per_class(None, "x") == {} and parse_per_class("", "x") == {}
    for bad, match in (("interactive", "CLASS=VALUE"), ("fast=0.5", "unknown latency class 'fast'"),
                       ("batch=half", "batch='half' is not a number")):
        with pytest.raises(ValueError, match=match):
            parse_per_class(bad, "adaptive_pruning")
    with pytest.raises(ValueError, match="ttft_slo_ms gives no TTFT objective for it"):
        objectives({"batch": 0.5}, {"interactive": 100.0})
    s = CoordinatorSettings(model="m", adaptive_pruning="interactive=0.5", ttft_slo_ms="interactive=2000,batch=9000")
    assert s.pruning_objectives() == {"interactive": ClassObjective(ttft_s=2.0, max_keep_ratio=0.5)}
    assert CoordinatorSettings(model="m").pruning_objectives() == {}  # off by default
    for kw, match in (({"adaptive_pruning": "interactive=0.5"}, "ttft_slo_ms"),
                      ({"adaptive_pruning": "interactive=1.5", "ttft_slo_ms": "interactive=10"}, "max_keep_ratio")):
        with pytest.raises(ValidationError, match=match):
            CoordinatorSettings(model="m", **kw)


def test_admission_counts_placeholders_and_marks_hashes_at_the_requests_own_ratio(tiny_model_dirs):
    builder = PromptBuilder(str(tiny_model_dirs["llava"]))
    img = make_image(200, 150, seed=3)
    payload = {"request_id": "r", "messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                                           {"type": "text", "text": "What?"}]}]}
    full = admit(builder, Limits(), payload)
    asked = []
    pruned = admit(builder, Limits(), payload, lambda cls: asked.append(cls) or 0.25)
    n = builder.family.visual_token_count((200, 150))
    assert asked == ["interactive"] and pruned.keep_ratio == 0.25 and full.keep_ratio is None
    assert pruned.visual_tokens == kept_tokens(n, 0.25) == pruned.prompt_ids.count(builder.family.image_token_id)
    assert full.visual_tokens == n and len(full.prompt_ids) - len(pruned.prompt_ids) == n - kept_tokens(n, 0.25)
    assert pruned.images[0].hash == pruned_hash(full.images[0].hash, 0.25) == full.images[0].hash + "#k0.25"
    # The same prompt as the fixed-ratio builder makes: one count rule.
    assert pruned.prompt_ids == PromptBuilder(str(tiny_model_dirs["llava"]), visual_token_pruning=0.25).prepare_text(
        "What?", [img]).prompt_ids
    assert admit(builder, Limits(), payload, lambda cls: None).images[0].hash == full.images[0].hash
    text_only = {"request_id": "t", "messages": [{"role": "user", "content": "hi"}]}
    assert admit(builder, Limits(), text_only, lambda cls: 1 / 0).keep_ratio is None  # never asked without images


def test_queued_work_counts_images_not_encoded_and_prompts_without_a_first_token():
    h = Harness(*DISAGG)
    h.t = 1.0
    h.submit(make_admitted("a", images=2, prompt_len=30))
    h.submit(make_admitted("b", prompt_len=10))
    work = queued_work(h.m.requests, h.m.members.routable())
    assert (work.images_to_encode, work.prompt_tokens_to_prefill, work.encoders, work.prefill_workers) == (2, 40, 2, 2)
    assert work.encode_s_per_image == 0.05 and work.prefill_tokens_per_s == 0.0  # nothing measured yet


def machine_with_pruning(slo_s: float, *roles) -> Harness:
    adaptive = AdaptivePruning({"interactive": ClassObjective(ttft_s=slo_s, max_keep_ratio=0.5, hold_s=3.0)})
    return Harness(*roles, adaptive_pruning=adaptive)


def test_a_class_past_its_objective_is_admitted_pruned_and_the_reply_says_so():
    h = machine_with_pruning(0.01, *DISAGG)
    ap = h.m.adaptive
    h.t = 1.0
    h.submit(make_admitted("first", images=1))
    assert ap.keep_ratio("interactive") is None  # nothing queued when it came
    h.advance(0.1)  # the tick sees one image to encode: 0.05 s (the default rate) > 0.01 s
    assert ap.keep_ratio("interactive") == 0.5 and ap.keep_ratio("batch") is None
    assert h.m.status()["adaptive_pruning"]["pruning"] == ["interactive"]
    adm = make_admitted("second", images=1)
    adm.keep_ratio = 0.5  # what admission makes of it now (hash marking: the test above)
    enc = only(h.submit(adm), MsgType.ENCODE)
    assert enc.body["keep_ratio"] == 0.5
    assert h.m.stats["pruned_adaptive"] == 1
    pre = only(h.encoded(enc.worker_id, enc), MsgType.PREFILL)
    dec = only(h.prefilled(pre.worker_id, pre, token=7), MsgType.DECODE)
    res = only(h.step(dec.worker_id, dec, [8], finished=True), MsgType.RESULT)
    assert res.body["visual_keep_ratio"] == 0.5
    # Load gone: pruning holds 3 s below release, then lifts.
    for st in h.m.requests.values():
        h.m.abort(st.client, st.client_rid, now=h.t)
    alive = tuple(w for w, _ in DISAGG)
    h.advance(2.0, beating=alive)
    assert ap.keep_ratio("interactive") == 0.5
    h.advance(2.0, beating=alive)
    assert ap.keep_ratio("interactive") is None


def test_below_its_objective_and_with_a_unified_worker_nothing_is_pruned():
    h = machine_with_pruning(60.0, *DISAGG)
    h.t = 1.0
    for i in range(20):
        h.submit(make_admitted(f"r{i}", images=2))
    h.advance(1.0)
    assert h.m.adaptive.keep_ratio("interactive") is None and h.m.adaptive.predicted_s > 0
    h = machine_with_pruning(0.01, *DISAGG, ("u0", "unified"))
    h.t = 1.0
    h.submit(make_admitted("r", images=1))
    h.advance(0.1)
    assert h.m.adaptive.governor.pruning("interactive") and h.m.adaptive.keep_ratio("interactive") is None


def test_a_pruned_request_never_runs_on_a_unified_worker():
    h = Harness(("u0", "unified"))
    h.t = 1.0
    pruned = make_admitted("p", images=1)
    pruned.keep_ratio = 0.5
    assert h.submit(pruned) == []  # waits for the stage pools: a unified worker cannot prune per request
    assert only(h.submit(make_admitted("q", images=1)), MsgType.RUN).worker_id == "u0"
    out = [m for wid, role in DISAGG for m in h.join(wid, role)]  # its pools are up: it goes on
    assert only(out, MsgType.ENCODE).body["keep_ratio"] == 0.5
