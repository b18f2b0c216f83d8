"""Admission at the edge: exact prompt ids before any pixel is decoded, and limits named in errors."""

from __future__ import annotations

import base64

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.admission import AdmissionError, Limits, admit
from tests.helpers import make_image


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def builder(request, tiny_model_dirs) -> PromptBuilder:
    return PromptBuilder(str(tiny_model_dirs[request.param]))


def generate(content, **kw):
    return {"request_id": "r1", "messages": [{"role": "user", "content": content}], **kw}


def test_prompt_ids_match_the_engine_path(builder):
    img = make_image(333, 222, seed=5)
    a = admit(builder, Limits(), generate([{"type": "image", "image": img}, {"type": "text", "text": "What?"}]))
    assert a.prompt_ids == builder.prepare_text("What?", [img]).prompt_ids
    assert a.visual_tokens == builder.family.visual_token_count((333, 222)) == a.prompt_ids.count(
        builder.family.image_token_id)
    data_url = "data:image/png;base64," + base64.b64encode(img).decode()
    b = admit(builder, Limits(), generate([{"type": "image_url", "image_url": {"url": data_url}},
                                           {"type": "text", "text": "What?"}]))
    assert b.prompt_ids == a.prompt_ids and b.images[0].hash == a.images[0].hash


@pytest.mark.parametrize("payload, limits, message", [
    ({"messages": []}, Limits(), "request_id: Field required"),
    (generate("hi", sampling={"max_tokens": 0}), Limits(), "sampling.max_tokens"),
    (generate("hi", sampling={"max_tokens": 10}), Limits(max_tokens=5), "over the limit max_tokens=5"),
    (generate("hi", sampling={"temprature": 1}), Limits(), "sampling.temprature: Extra inputs are not permitted"),
    (generate([{"type": "image", "image": b"junk"}]), Limits(), "image 0: cannot read image header"),
    (generate([{"type": "image", "image": "/etc/passwd"}]), Limits(), "not a file path"),
    (generate([{"type": "audio"}]), Limits(), "unsupported content part type 'audio'"),
    (generate("   "), Limits(), "prompt is empty"),
    (generate("word " * 300), Limits(max_prompt_tokens=100), "over the limit max_prompt_tokens=100"),
])
def test_bad_requests_name_the_problem(builder, payload, limits, message):
    with pytest.raises(AdmissionError, match=message.replace("(", r"\(")):
        admit(builder, limits, payload)


def test_image_limits(builder):
    big = make_image(600, 400)
    with pytest.raises(AdmissionError, match=r"600x400 = 240000 pixels, over the limit max_image_pixels=100000"):
        admit(builder, Limits(max_image_pixels=100_000), generate([{"type": "image", "image": big}]))
    with pytest.raises(AdmissionError, match="over the limit max_image_bytes=1000"):
        admit(builder, Limits(max_image_bytes=1000), generate([{"type": "image", "image": big}]))
    three = [{"type": "image", "image": make_image(20, 20, seed=i)} for i in range(3)]
    with pytest.raises(AdmissionError, match="3 images is over the limit max_images_per_request=2"):
        admit(builder, Limits(max_images_per_request=2), generate(three))
