"""Audio through the OpenAI edge: OpenAI's input_audio part and vLLM's audio_url part become mserve's audio
part (the server's normalize_messages takes it), bad parts name their field, /v1/models says which
modalities each model takes, and the Python client's walk takes audio as it takes images."""

from __future__ import annotations

import asyncio
import base64

import pytest

from mserve.gateway.openai_api import parse_chat_request
from tests.audio_clips import make_audio
from tests.gateway.chat_requests import body, param_of

CLIP = make_audio(1600, 8000, "wav")
B64 = base64.b64encode(CLIP).decode()


def test_input_audio_and_audio_url_become_audio_parts():
    from mserve.common.audio import AudioPart
    from mserve.common.prompt import normalize_messages

    req = parse_chat_request(body(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + B64}},
        {"type": "text", "text": "What is it?"}]}]))
    assert req.messages[0]["content"] == [{"type": "audio", "audio": CLIP}, {"type": "audio", "audio": CLIP},
                                          {"type": "text", "text": "What is it?"}]
    norm, items = normalize_messages(req.messages, allow_paths=False)
    assert items == [AudioPart(CLIP), AudioPart(CLIP)] and norm[0]["content"][0] == {"type": "audio"}


@pytest.mark.parametrize("part, param", [
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "messages[0].content[0].input_audio.data"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "messages[0].content[0].input_audio.data"),
    ({"type": "input_audio", "input_audio": {"data": B64, "format": "aac"}}, "messages[0].content[0].input_audio.format"),
    ({"type": "input_audio", "input_audio": B64}, "messages[0].content[0].input_audio.data"),
    ({"type": "audio_url", "audio_url": {}}, "messages[0].content[0].audio_url"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "messages[0].content[0].audio_url"),
    ({"type": "audio_url", "audio_url": {"url": "/etc/passwd"}}, "messages[0].content[0].audio_url"),
])
def test_bad_audio_parts_name_the_field(part, param):
    assert param_of(lambda: parse_chat_request(body(messages=[{"role": "user", "content": [part]}]))) == param


def test_models_say_their_modalities(tiny_model_dirs):
    from mserve.common.model import load_family
    from mserve.gateway.models import ModelCatalog

    assert load_family(tiny_model_dirs["qwen2_audio"]).modalities == ["text", "audio"]
    assert load_family(tiny_model_dirs["llava"]).modalities == ["text", "image", "video"]  # a video as its frames

    async def status():
        return {"model": "/m/a", "served_models": ["/m/a", "/m/old"],
                "models": {"/m/a": {"model_path": "/m/a", "modalities": ["text", "audio"]}, "/m/old": {}}}

    catalog = ModelCatalog(status, "voice", None)
    asyncio.run(catalog.refresh())
    assert [(n, catalog.modalities(n)) for n in catalog.names()] == [("voice", ["text", "audio"]), ("/m/old", None)]


def test_client_takes_audio_like_images(tmp_path):
    from mserve.coordinator.client_core import normalize_client_messages

    path = tmp_path / "clip.wav"
    path.write_bytes(CLIP)
    out = normalize_client_messages([{"role": "user", "content": [
        {"type": "audio", "audio": path}, {"type": "audio", "audio": str(path)},
        {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}, {"type": "text", "text": "?"}]}])
    assert out[0]["content"][:3] == [{"type": "audio", "audio": CLIP}] * 3
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: audio path"):
        normalize_client_messages([{"role": "user", "content": [{"type": "audio", "audio": str(tmp_path / "none")}]}])
