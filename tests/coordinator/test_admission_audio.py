"""Audio at admission: the clip's tokens from its container header (no sample decoded), its hash and
wire form, and every limit and bad file refused with a message naming the field and the limit."""

from __future__ import annotations

import base64

import pytest

from mserve.common.audio import AudioPart
from mserve.common.prompt import PromptBuilder
from mserve.common.protocol import ErrorCode
from mserve.coordinator.admission import AdmissionError, Limits, admit
from tests.audio_clips import make_audio


@pytest.fixture(scope="module")
def builder(tiny_model_dirs) -> PromptBuilder:
    return PromptBuilder(str(tiny_model_dirs["qwen2_audio"]))


def generate(content, **kw):
    return {"request_id": "r1", "messages": [{"role": "user", "content": content}], **kw}


def test_openai_and_vllm_parts_admit_as_the_engine_prepares(builder):
    clip = make_audio(20000, 22050, "mp3", seed=1)
    engine_side = builder.prepare([{"role": "user", "content": [{"type": "audio", "audio": clip},
                                                                 {"type": "text", "text": "What?"}]}])
    b64 = base64.b64encode(clip).decode()
    openai = admit(builder, Limits(), generate([{"type": "input_audio", "input_audio": {"data": b64, "format": "mp3"}},
                                                {"type": "text", "text": "What?"}]))
    vllm = admit(builder, Limits(), generate([{"type": "audio_url", "audio_url": {"url": "data:audio/mpeg;base64," + b64}},
                                              {"type": "text", "text": "What?"}]))
    assert openai.prompt_ids == vllm.prompt_ids == engine_side.prompt_ids
    (im,) = openai.images
    assert im.audio_samples == engine_side.images[0].samples == 14513 and not im.is_video and im.skippable
    assert im.num_tokens == openai.prompt_ids.count(builder.family.audio_token_id) == 23
    assert im.hash == vllm.images[0].hash != admit(builder, Limits(), generate(
        [{"type": "audio", "audio": make_audio(20000, 22050, "mp3", seed=2)}])).images[0].hash
    from mserve.coordinator.telemetry import modality

    assert im.kind == "audio" and modality(openai.images) == "audio"  # the metrics' modality label


def test_wire_form_round_trips_to_the_workers_audio_part(builder):
    from mserve.common.protocol.to_worker import ImageRef
    from mserve.workers.roles.encode import visual_input

    a = admit(builder, Limits(), generate([{"type": "audio", "audio": make_audio(8000, 8000, "wav")}]))
    im = a.images[0]
    import msgpack

    body = ImageRef(hash=im.hash, data=im.data, audio_samples=im.audio_samples).to_body()
    ref = ImageRef.from_body(msgpack.unpackb(msgpack.packb(body)))
    assert visual_input(ref) == AudioPart(im.data, 16000)


def _wav_with_format_tag(tag: int) -> bytes:
    data = bytearray(make_audio(4000, 8000, "wav"))
    data[20:22] = tag.to_bytes(2, "little")
    return bytes(data)


CLIP = make_audio(16000, 16000, "wav")


@pytest.mark.parametrize("content, limits, message, code", [
    ([{"type": "audio", "audio": CLIP}] * 3, Limits(max_audio_per_request=2),
     "3 audio clips is over the limit max_audio_per_request=2", ErrorCode.BAD_REQUEST),
    ([{"type": "audio", "audio": CLIP}], Limits(max_audio_bytes=1000),
     f"audio 0 is {len(CLIP)} bytes, over the limit max_audio_bytes=1000", ErrorCode.TOO_LARGE),
    ([{"type": "audio", "audio": CLIP}], Limits(max_audio_seconds=0.5),
     "audio 0 is 1.000 s, over the limit max_audio_seconds=0.5", ErrorCode.TOO_LARGE),
    ([{"type": "audio", "audio": make_audio(0, 16000, "wav")}], Limits(),
     "audio 0 is 0.000 s, too short for one audio token of qwen2_audio \\(a clip must be at least 0.020 s\\)",
     ErrorCode.BAD_REQUEST),
    ([{"type": "audio", "audio": CLIP[: len(CLIP) // 2]}], Limits(),
     "audio 0: truncated: its data chunk says 32000 bytes", ErrorCode.BAD_REQUEST),
    ([{"type": "audio", "audio": _wav_with_format_tag(0x7777)}], Limits(), "audio 0: unknown codec", ErrorCode.BAD_REQUEST),
    ([{"type": "audio", "audio": b"not audio at all" * 4}], Limits(), "audio 0: cannot read the audio container",
     ErrorCode.BAD_REQUEST),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}], Limits(),
     "input_audio.format must be one of wav, mp3, flac, ogg", ErrorCode.BAD_REQUEST),
    ([{"type": "input_audio", "input_audio": {"data": "@@not base64", "format": "wav"}}], Limits(),
     "input_audio.data is not valid base64", ErrorCode.BAD_REQUEST),
    ([{"type": "audio", "audio": "/etc/passwd"}], Limits(), "audio must be bytes or a data URL, not a file path",
     ErrorCode.BAD_REQUEST),
])
def test_bad_audio_is_refused_by_name(builder, content, limits, message, code):
    with pytest.raises(AdmissionError, match=message) as err:
        admit(builder, limits, generate(content))
    assert err.value.code == code


def test_audio_for_a_model_without_an_audio_tower_names_model_and_modality(tiny_model_dirs):
    image_model = PromptBuilder(str(tiny_model_dirs["llava"]))
    with pytest.raises(AdmissionError, match="audio 0: model tiny-llava takes no audio input "
                                             r"\(model_type llava has no audio tower mserve serves\)"):
        admit(image_model, Limits(), generate([{"type": "audio", "audio": CLIP}], model="tiny-llava"))
