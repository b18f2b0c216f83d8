"""Building OpenAI chat bodies for the gateway's parser, and reading which field a 400 names."""

from __future__ import annotations

import pytest

from mserve.gateway.openai_api import ApiError


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def param_of(call) -> str | None:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == 400
    return info.value.param
