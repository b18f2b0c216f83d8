"""coordinator/models.py: which served model a request's `model` reaches, and when it is refused. Pure: real
request machines, workers joined by READY messages, no sockets."""

from __future__ import annotations

import pytest

from mserve.common.protocol import ErrorCode, MsgType
from mserve.common.protocol.to_coordinator import WorkerInfo
from mserve.coordinator.models import ModelTable, ModelUnavailable, ServedModel, serving_model
from mserve.coordinator.requests import RequestMachine
from mserve.coordinator.settings import MachineSettings


def served(name: str, *roles: str) -> ServedModel:
    model = ServedModel(name, f"/models/{name}", builder=None, machine=RequestMachine(raise_errors=True))
    for i, role in enumerate(roles):
        join(model, f"{name}-{role}-{i}", role)
    return model


def join(model: ServedModel, worker_id: str, role: str) -> None:
    model.machine.on_worker(worker_id, MsgType.READY, WorkerInfo(worker_id=worker_id, role=role, data_address="tcp://x:1",
                                                                host_id="h", model=model.name), now=0.0)


def refusal(requested, models, default) -> ModelUnavailable:
    with pytest.raises(ModelUnavailable) as err:
        serving_model(requested, models, default)
    return err.value


def test_a_request_reaches_the_model_it_names_else_the_default_else_the_only_one():
    a, b = served("a", "prefill", "decode"), served("b", "unified")
    models = {"a": a, "b": b}
    assert serving_model("b", models, "a") is b
    assert serving_model(None, models, "a") is a
    assert serving_model(None, {"b": b}, None) is b
    err = refusal(None, models, None)
    assert err.code == ErrorCode.BAD_REQUEST and "'a', 'b'" in str(err)


def test_an_unknown_model_or_one_without_live_workers_is_not_found_naming_the_served_ones():
    a, gone = served("a", "prefill", "decode"), served("gone")
    err = refusal("gone", {"a": a, "gone": gone}, None)
    assert err.code == ErrorCode.MODEL_NOT_FOUND and "'gone'" in str(err) and "served models: 'a'" in str(err)
    assert refusal("x", {"a": a}, None).code == ErrorCode.MODEL_NOT_FOUND


def test_a_model_missing_its_decode_pool_is_refused_naming_it_but_a_missing_encoder_only_parks():
    no_decode = served("a", "encode", "prefill")
    err = refusal("a", {"a": no_decode}, None)
    assert err.code == ErrorCode.NO_WORKERS and "no live decode worker" in str(err)
    text_pools = served("t", "prefill", "decode")  # image requests wait for an encoder (from zero)
    assert serving_model("t", {"t": text_pools}, None) is text_pools


def test_the_default_model_is_served_before_its_first_worker_joins():
    cold = served("a")
    assert serving_model(None, {"a": cold}, "a") is cold  # requests wait for its workers, as a cold start does


def test_workers_join_their_own_model_made_on_its_first_worker():
    made = []

    def make(name: str, path: str) -> ServedModel:
        made.append((name, path))
        return ServedModel(name, path, builder=None, machine=RequestMachine(raise_errors=True))

    table = ModelTable("a", "/m/a", make)
    info = WorkerInfo(worker_id="w1", role="decode", data_address="tcp://x:1", host_id="h", model="b",
                      model_path="/m/b")
    b = table.register("w1", info)
    table.register("w2", WorkerInfo(worker_id="w2", role="decode", data_address="tcp://x:1", host_id="h",
                                    model="b", model_path="/m/b"))
    assert made == [("a", "/m/a"), ("b", "/m/b")]  # one per model, not per worker
    assert table.of_worker("w1") is b and table.of_worker("w2") is b and table.of_worker("w3") is None
    old = table.register("w3", WorkerInfo(worker_id="w3", role="decode", data_address="tcp://x:1", host_id="h"))
    assert old is table.get("a")  # a worker that names no model serves the coordinator's


def test_a_flood_on_one_model_sheds_that_models_lowest_class_and_leaves_the_other_alone():
    from tests.coordinator.test_request_machine import make_admitted

    def make(name: str, path: str) -> ServedModel:
        return ServedModel(name, path, builder=None, machine=RequestMachine(MachineSettings(max_waiting_requests=2), raise_errors=True))

    table = ModelTable(None, None, make)
    for model in ("a", "b"):
        for role in ("prefill", "decode"):
            wid = f"{model}-{role}"
            info = WorkerInfo(worker_id=wid, role=role, data_address="tcp://x:1", host_id="h", model=model,
                              model_path=f"/m/{model}")
            table.register(wid, info).machine.on_worker(wid, MsgType.READY, info, now=0.0)
    a, b = table.serving("a").machine, table.serving("b").machine
    for rid in ("a1", "a2"):
        a.submit(b"client", make_admitted(rid, latency_class="batch"), now=1.0)
    b.submit(b"client", make_admitted("b1", latency_class="batch"), now=1.0)  # b's own bound: not shed
    out = a.submit(b"client", make_admitted("a3"), now=2.0)  # interactive, over a's max_waiting_requests
    shed = [m for m in out if m.kind == MsgType.ERROR]
    assert len(shed) == 1 and shed[0].body["code"] == ErrorCode.OVERLOADED and shed[0].body["request_id"] == "a1"
    assert a.status()["stats"]["shed"] == 1 and b.status()["stats"]["shed"] == 0
    assert b.status()["requests_in_flight"] == 1


def test_a_pool_whose_last_worker_drains_parks_requests_rather_than_refusing_them():
    from mserve.common.protocol.to_coordinator import Heartbeat, WorkerLoad

    model = served("a", "prefill", "decode")
    model.machine.on_worker("a-decode-1", MsgType.HEARTBEAT, Heartbeat(worker_id="a-decode-1",
                                                                       load=WorkerLoad(draining=True)), now=0.1)
    assert model.machine.members.routable() and "decode" not in {w.role for w in model.machine.members.routable()}
    assert serving_model("a", {"a": model}, None) is model  # its replacement is on the way: wait for it


# -- variant groups (--variant-groups): the router in ModelTable.serving ----------------------------------

def group_table(slo_ms: float = 1000.0):
    from mserve.coordinator.models import VariantRouter
    from mserve.coordinator.variant_policy import parse_variant_groups, variant_rule

    router = VariantRouter(parse_variant_groups("pair=small,large"), variant_rule({"interactive": slo_ms}, hold_s=2.0))
    table = ModelTable(None, None, lambda name, path: served(name), router)
    for name in ("small", "large"):
        for role in ("encode", "prefill", "decode"):
            table.register(f"{name}-{role}", WorkerInfo(worker_id=f"{name}-{role}", role=role, data_address="tcp://x:1",
                                                      host_id="h", model=name, model_path=f"/models/{name}"))
            join(table.get(name), f"{name}-{role}", role)
    return table, router


def back_up_large(table: ModelTable, images: int) -> None:
    """Image requests waiting on the large variant's encoder: its predicted TTFT grows 0.05 s an image."""
    from tests.coordinator.test_request_machine import make_admitted

    large = table.get("large")
    for i in range(images // 4):
        large.machine.submit(b"client", make_admitted(f"wait{i}", images=4), now=0.0)


def test_a_group_routes_batch_to_its_largest_and_interactive_down_only_past_the_objective():
    table, router = group_table(slo_ms=1000.0)
    assert table.served_names() == ["large", "pair", "small"] and table.groups() == {"pair": ["small", "large"]}
    assert table.serving("pair", "interactive", now=0.0).name == "large"  # idle: the largest meets it
    back_up_large(table, images=40)  # 40 images x 0.05 s = 2 s predicted on large: over the 1 s objective
    assert table.serving("pair", "batch", now=1.0).name == "large"  # batch never moves down
    assert table.serving("pair", "interactive", now=1.0).name == "small"
    assert table.serving("small", "interactive", now=1.0).name == "small"  # a variant by its own name: as asked
    assert router.chosen == {("pair", "large"): 2, ("pair", "small"): 1}


def test_a_group_with_no_live_variant_is_refused_naming_it():
    table, _ = group_table()
    for name in ("small", "large"):
        for role in ("encode", "prefill", "decode"):
            table.get(name).machine.on_worker(f"{name}-{role}", MsgType.BYE, {"worker_id": f"{name}-{role}"}, now=0.0)
    assert "pair" not in table.served_names()
    with pytest.raises(ModelUnavailable) as err:
        table.serving("pair", "batch", now=0.0)
    assert err.value.code == ErrorCode.NO_WORKERS and "'pair'" in str(err.value) and "small, large" in str(err.value)
