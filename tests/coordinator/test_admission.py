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
    (generate([{"type": "audio"}]), Limits(), "audio is not usable"),
    (generate([{"type": "sound"}]), Limits(), "unsupported content part type 'sound'"),
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


def test_video_token_count_is_exact(builder):
    """Qwen2-VL: 120x90 frames -> 84x112 -> a 6x8 patch grid; 4 frames -> 2 temporal patches -> 2*48/4 = 24
    tokens of <|video_pad|>. LLaVA: each frame an image (64 tokens at the tiny model's 112 px)."""
    from mserve.common.model import VideoInfo
    from tests.helpers import make_frames

    frames = make_frames(120, 90, 4, seed=1)
    content = [{"type": "video", "video": frames}, {"type": "text", "text": "What happens?"}]
    a = admit(builder, Limits(), generate(content))
    family, video = builder.family, a.images[0]
    want = 24 if family.model_type == "qwen2_vl" else 4 * 64
    assert a.visual_tokens == video.num_tokens == family.video_token_count(VideoInfo(4, 120, 90)) == want
    assert video.is_video and video.frames == frames and video.size == (120, 90)
    placeholder = family.image_token_id if family.video_as_frames else family.video_token_id
    assert a.prompt_ids.count(placeholder) == want
    assert a.prompt_ids == builder.prepare([{"role": "user", "content": content}]).prompt_ids
    urls = ["data:image/png;base64," + base64.b64encode(f).decode() for f in frames]
    b = admit(builder, Limits(), generate([{"type": "video", "video": urls}, {"type": "text", "text": "What happens?"}]))
    assert b.prompt_ids == a.prompt_ids and b.images[0].hash == video.hash


def test_odd_frame_count_is_padded_to_whole_temporal_patches(builder):
    from tests.helpers import make_frames

    a = admit(builder, Limits(), generate([{"type": "video", "video": make_frames(120, 90, 3, seed=2)}]))
    # Qwen2-VL repeats the last frame: 3 frames cost what 4 do. LLaVA: 3 images.
    assert a.visual_tokens == (24 if builder.family.model_type == "qwen2_vl" else 3 * 64)


def test_video_limits(builder):
    from tests.helpers import make_frames

    five = generate([{"type": "video", "video": make_frames(40, 30, 5)}])
    with pytest.raises(AdmissionError, match="video 0 has 5 frames, over the limit max_video_frames=4") as info:
        admit(builder, Limits(max_video_frames=4), five)
    assert info.value.code == "too_large"
    admit(builder, Limits(max_video_frames=5), five)
    mixed = generate([{"type": "video", "video": [make_image(40, 30), make_image(41, 30)]}])
    with pytest.raises(AdmissionError, match="all frames of a video must have the same size"):
        admit(builder, Limits(), mixed)
    with pytest.raises(AdmissionError, match=r"video 1 frames are 600x400 = 240000 pixels, over the limit"):
        admit(builder, Limits(max_image_pixels=100_000),
              generate([{"type": "text", "text": "x"}, {"type": "image", "image": make_image(20, 20)},
                        {"type": "video", "video": [make_image(600, 400)] * 2}]))


def test_video_file_is_sampled_at_admission(builder):
    pytest.importorskip("av")
    from tests.helpers import make_frames, make_video_file

    clip = make_video_file(make_frames(112, 84, 9, seed=3), fps=4)  # 2.25 s
    a = admit(builder, Limits(), generate([{"type": "video", "video": clip}]))
    assert a.images[0].frame_indices == [0, 1, 3, 5, 7] and a.images[0].data == clip  # 2 per second
    b = admit(builder, Limits(max_video_frames=4, video_fps=30.0), generate([{"type": "video", "video": clip}]))
    assert b.images[0].frame_indices == [0, 2, 4, 6] and b.images[0].hash != a.images[0].hash  # capped, spread
    per_frame = 12 if builder.family.model_type == "qwen2_vl" else 64  # 112x84: a 6x8 grid / 4; LLaVA 64
    assert b.visual_tokens == (2 if builder.family.model_type == "qwen2_vl" else 4) * per_frame
    with pytest.raises(AdmissionError, match="video 0: cannot read video file"):
        admit(builder, Limits(), generate([{"type": "video", "video": b"not a video at all"}]))
