"""Audio at admission and on the encode worker (common/audio.py, common/families/qwen2_audio.py): the
token count read from a container's header equals Qwen2AudioProcessor's own count of the waveform the
worker decodes, for several formats, durations and sample rates; bad files are refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mserve.common.audio import AudioError, decode_audio, read_audio_header
from mserve.common.families.qwen2_audio import read_audio_features
from tests.audio_clips import make_audio


@pytest.fixture(scope="module")
def processor(tiny_model_dirs):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_dirs["qwen2_audio"])


def _processor_count(processor, clip: np.ndarray) -> int:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio", "audio_url": "a"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, audio=[clip], sampling_rate=16000, return_tensors="pt")
    return int((inputs["input_ids"] == processor.audio_token_id).sum())


@pytest.mark.parametrize("fmt, rate, samples", [
    ("wav", 16000, 16000), ("wav", 16000, 161), ("wav", 16000, 3), ("wav", 8000, 12345), ("wav", 44100, 30001),
    ("wav", 22050, 70000),  # over the tiny window (3 s): cut to it, as the processor cuts
    ("flac", 44100, 12345), ("flac", 48000, 20000), ("mp3", 22050, 12345), ("mp3", 44100, 40000),
    ("ogg", 48000, 12345), ("ogg", 48000, 47000),
])
def test_header_count_is_the_processors_count(processor, tiny_model_dirs, fmt, rate, samples):
    features = read_audio_features(tiny_model_dirs["qwen2_audio"])
    data = make_audio(samples, rate, fmt)
    info = read_audio_header(data)
    assert (info.sample_rate, info.samples) == (rate, samples)
    n = info.resampled_samples(features.sampling_rate)
    raw = decode_audio(data, features.sampling_rate)
    assert abs(len(raw) - n) <= 2  # holding the waveform to n only trims a resampler's flush
    clip = decode_audio(data, features.sampling_rate, n)
    assert len(clip) == n
    assert features.tokens(n) == _processor_count(processor, clip)


def test_window_and_empty_clip(tiny_model_dirs):
    features = read_audio_features(tiny_model_dirs["qwen2_audio"])
    assert features.max_seconds == 3.0
    assert features.tokens(0) == 0 and features.tokens(160) == 0  # one frame: nothing after conv + pool
    assert features.tokens(10 ** 9) == features.tokens(features.n_samples) == 75
    assert read_audio_header(make_audio(0, 16000, "wav")).samples == 0


def test_truncated_wav_is_refused():
    data = make_audio(16000, 16000, "wav")
    with pytest.raises(AudioError, match="truncated: its data chunk says 32000 bytes"):
        read_audio_header(data[: len(data) // 2])


@pytest.mark.parametrize("fmt", ["flac", "mp3", "ogg"])
def test_truncated_compressed_file_is_refused(fmt):
    data = make_audio(40000, 44100 if fmt != "ogg" else 48000, fmt)
    with pytest.raises(AudioError, match="truncated|cannot read the audio container"):
        read_audio_header(data[: len(data) // 2])


def test_unknown_codec_and_junk_are_refused():
    bad = bytearray(make_audio(1000, 8000, "wav"))
    bad[20:22] = struct.pack("<H", 0x7777)  # a WAVE format tag no decoder knows
    with pytest.raises(AudioError, match="unknown codec"):
        read_audio_header(bytes(bad))
    with pytest.raises(AudioError, match="cannot read the audio container"):
        read_audio_header(b"hello world" * 10)
    with pytest.raises(AudioError, match="cannot read the audio container|no audio stream"):
        read_audio_header(b"RIFF\x00\x00\x00\x00WAVE")
