"""Fuzzing audio at the edges (hypothesis, bounded), beside tests/common/test_fuzz.py's images: a clip's
header either reads or raises AudioError, a header-accepted clip decodes or raises AudioError, admission
ends in an AdmissionError naming the problem or an exact count, and OpenAI's audio parts parse or get a 400."""

from __future__ import annotations

import base64

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mserve.common.audio import AudioError, decode_audio, read_audio_header
from mserve.coordinator.admission import AdmissionError, Limits, admit
from mserve.gateway.openai_api import ApiError, parse_chat_request
from tests.audio_clips import make_audio

BOUNDED = settings(max_examples=120, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOOD = [make_audio(3000, rate, fmt, seed=1) for fmt, rate in (("wav", 16000), ("flac", 44100), ("mp3", 22050),
                                                               ("ogg", 48000))]
# real clips, cut ones, ones with one byte changed, junk
audio_bytes = st.sampled_from(GOOD) | st.builds(lambda d, cut: d[:cut], st.sampled_from(GOOD), st.integers(0, 2000)) \
    | st.builds(lambda d, i, b: d[:i] + bytes([b]) + d[i + 1:], st.sampled_from(GOOD), st.integers(0, 400),
                st.integers(0, 255)) | st.binary(max_size=64)


@pytest.fixture(scope="module")
def builder(tiny_model_dirs):
    from mserve.common.prompt import PromptBuilder

    return PromptBuilder(tiny_model_dirs["qwen2_audio"])


@BOUNDED
@given(audio_bytes)
def test_clips_read_and_decode_or_raise_audio_error(data):
    try:
        info = read_audio_header(data)
    except AudioError as exc:
        assert str(exc)
        return
    assert info.sample_rate > 0 and info.samples >= 0
    try:
        wave = decode_audio(data, 16000, info.resampled_samples(16000))
    except AudioError as exc:
        assert str(exc)
        return
    assert len(wave) == info.resampled_samples(16000)


@BOUNDED
@given(audio_bytes)
def test_admission_of_any_clip_ends_in_a_named_error_or_an_exact_count(builder, data):
    body = {"request_id": "r", "messages": [{"role": "user", "content": [{"type": "audio", "audio": data}]}]}
    try:
        admitted = admit(builder, Limits(), body)
    except AdmissionError as exc:
        assert str(exc).startswith("audio 0") and exc.code in ("bad_request", "too_large")
        return
    (clip,) = admitted.images
    assert clip.num_tokens == admitted.prompt_ids.count(builder.family.audio_token_id) >= 1


parts = st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "audio_url"])}, optional={
    "input_audio": st.none() | st.text(max_size=8) | st.fixed_dictionaries({}, optional={
        "data": st.text(max_size=12) | st.builds(lambda d: base64.b64encode(d).decode(), audio_bytes) | st.integers(),
        "format": st.sampled_from(["wav", "mp3", "flac", "ogg", "aac", "", None])}),
    "audio_url": st.none() | st.text(max_size=20) | st.fixed_dictionaries({}, optional={
        "url": st.text(max_size=20) | st.builds(lambda d: "data:audio/wav;base64," + base64.b64encode(d).decode(),
                                               audio_bytes)})})


@BOUNDED
@given(st.lists(parts, min_size=1, max_size=3))
def test_openai_audio_parts_parse_or_get_a_400(content):
    try:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": content}]})
    except ApiError as exc:
        assert exc.status == 400 and exc.param and exc.param.startswith("messages[0].content[")
