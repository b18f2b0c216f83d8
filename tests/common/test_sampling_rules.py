"""Every door takes its sampling defaults and bounds from common/sampling_rules.py: the wire, the Python
client's GENERATE body, admission, the OpenAI gateway and the engine agree, in process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mserve.common import sampling_rules as rules
from mserve.common.protocol.client import Generate, Sampling
from mserve.coordinator.admission import GenerateIn
from mserve.coordinator.client_core import generate_body
from mserve.gateway.openai_api import ApiError, parse_chat_request
from mserve.gateway.settings import GatewaySettings
from mserve.workers.sequence import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]
DEFAULTS = {"max_tokens": rules.MAX_TOKENS, "temperature": rules.TEMPERATURE, "top_k": rules.TOP_K,
            "top_p": rules.TOP_P}


def defaults_of(s) -> dict:
    return {name: getattr(s, name) for name in DEFAULTS}


def test_every_door_has_the_same_defaults():
    body = Generate.from_body(generate_body("r", MESSAGES, False))
    admitted = GenerateIn(request_id="r", messages=MESSAGES).to_wire()
    for s in (Sampling(), body.sampling, admitted.sampling, SamplingParams(), SamplingParams.from_wire(Sampling())):
        assert defaults_of(s) == DEFAULTS
    assert body.priority == admitted.priority == rules.PRIORITY
    assert GatewaySettings().default_max_tokens == rules.MAX_TOKENS
    assert parse_chat_request({"model": "m", "messages": MESSAGES}).sampling == {"max_tokens": rules.MAX_TOKENS}


@pytest.mark.parametrize("name,value", [("temperature", 2.5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                        ("top_k", -1), ("max_tokens", 0)])
def test_every_door_refuses_the_same_sampling_values(name, value):
    bound = rules.BOUNDS[name]
    with pytest.raises(ValueError, match=rf"{name} must be {bound.describe()}".replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**{name: value})
    with pytest.raises(ValidationError, match=name):
        GenerateIn(request_id="r", messages=MESSAGES, sampling={name: value})
    with pytest.raises(ApiError) as info:
        parse_chat_request({"model": "m", "messages": MESSAGES, name: value})
    assert info.value.param == name and bound.describe() in str(info.value)
    assert all(rules.BOUNDS[n].ok(v) for n, v in DEFAULTS.items())


@pytest.mark.parametrize("value", [-101, 101])
def test_priority_bounds_are_one_rule(value):
    with pytest.raises(ValidationError, match="priority"):
        GenerateIn(request_id="r", messages=MESSAGES, priority=value)
    with pytest.raises(ApiError) as info:
        parse_chat_request({"model": "m", "messages": MESSAGES, "priority": value})
    assert info.value.param == "priority"
    assert GenerateIn(request_id="r", messages=MESSAGES, priority=100).priority == 100


def test_bound_descriptions():
    assert [rules.BOUNDS[n].describe() for n in ("max_tokens", "top_p", "temperature")] == [
        ">= 1", "in (0, 1]", "in [0, 2]"]
    assert rules.BOUNDS["top_p"].pydantic() == {"gt": 0, "le": 1}
