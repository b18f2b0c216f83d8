"""Voxtral through the engine gives exactly Hugging Face generate()'s greedy tokens.

The prompt is mserve's (PromptBuilder: the Tekken tokenizer's encoding, each clip's count from its
container header); HF gets the same turns through VoxtralProcessor.apply_chat_template with the
waveforms the engine decodes (common/audio.py: decode_audio), whose ids must equal mserve's prompt ids,
so admission's count is the processor's. These check the model path: the padding to 30 s chunks, the
tower and projector (workers/audio_encoding.py), the scatter, chunked prefill and the prefix cache.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache

import pytest
import torch

from mserve.common.audio import decode_audio
from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.audio_clips import make_audio

MAX_NEW = 8
TEXT = "What is this sound?"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["voxtral"])


@lru_cache(maxsize=2)
def _reference(model_dir: str):
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    model = AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def processor_inputs(model_dir: str, pp, text: str = TEXT):
    """VoxtralProcessor's own inputs for one user turn of pp's clips (as the engine decodes them) and text."""
    import soundfile

    _, processor = _reference(model_dir)
    rate = processor.feature_extractor.sampling_rate
    content = []
    for part in pp.images:
        buf = io.BytesIO()
        soundfile.write(buf, decode_audio(part.data, rate, part.samples), rate, format="WAV", subtype="FLOAT")
        content.append({"type": "audio", "base64": base64.b64encode(buf.getvalue()).decode()})
    return processor.apply_chat_template([{"role": "user", "content": content + [{"type": "text", "text": text}]}])


def hf_generate(model_dir: str, pp, text: str = TEXT) -> list[int]:
    model, _ = _reference(model_dir)
    inputs = processor_inputs(model_dir, pp, text)
    assert inputs["input_ids"][0].tolist() == pp.prompt_ids  # admission's count is the processor's
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def new_engine(model_dir: str, **overrides) -> Engine:
    return Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 128, "block_size": 16, **overrides}))


def prompt(model_dir: str, clips: list[bytes], text: str = TEXT):
    content = [{"type": "audio", "audio": c} for c in clips] + [{"type": "text", "text": text}]
    return PromptBuilder(model_dir).prepare([{"role": "user", "content": content}])


def run(engine: Engine, requests: dict) -> dict[str, list[int]]:
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()
    engine.pool.check_integrity()
    return out


@pytest.mark.parametrize("samples, rate, fmt", [(1600, 16000, "wav"), (480000, 16000, "wav"), (1323000, 44100, "flac"),
                                                (1323441, 44100, "wav"), (50000, 22050, "mp3")])
def test_admission_count_is_the_processors(model_dir, samples, rate, fmt):
    """0.1 s, exactly 30 s (at 16 kHz and resampled from 44.1 kHz), just over 30 s, an mp3: one chunk or two."""
    pp = prompt(model_dir, [make_audio(samples, rate, fmt, seed=1)])
    assert processor_inputs(model_dir, pp)["input_ids"][0].tolist() == pp.prompt_ids
    assert pp.prompt_ids.count(PromptBuilder(model_dir).family.audio_token_id) in (375, 750)


def test_one_clip(model_dir):
    pp = prompt(model_dir, [make_audio(20000, 22050, "mp3", seed=1)])
    engine = new_engine(model_dir)
    expected = hf_generate(model_dir, pp)
    assert run(engine, {"r": pp})["r"] == expected
    assert engine.counters["encoded_images"] == 1 and engine.pool.num_used_blocks == 0
    # Not vacuous: another clip of the same length and format gives the tiny model other tokens.
    assert hf_generate(model_dir, prompt(model_dir, [make_audio(20000, 22050, "mp3", seed=9)])) != expected


def test_two_clips_in_one_prompt(model_dir):
    pp = prompt(model_dir, [make_audio(16000, 16000, "wav", seed=2), make_audio(496000, 16000, "wav", seed=3)])
    runs = PromptBuilder(model_dir).family.image_spans(pp.prompt_ids)
    assert [n for _, n in runs] == [375, 750]
    assert run(new_engine(model_dir), {"r": pp})["r"] == hf_generate(model_dir, pp)


def test_ragged_batch(model_dir):
    """Three requests of different clip lengths (and one without audio) in one batch."""
    pps = {"a": prompt(model_dir, [make_audio(8000, 16000, "wav", seed=4)]),
           "b": prompt(model_dir, [make_audio(47000, 48000, "ogg", seed=5)], "Describe it."),
           "c": PromptBuilder(model_dir).prepare([{"role": "user", "content": "Say something."}])}
    out = run(new_engine(model_dir), pps)
    assert out["a"] == hf_generate(model_dir, pps["a"]) and out["b"] == hf_generate(model_dir, pps["b"], "Describe it.")
    model, processor = _reference(model_dir)
    ids = torch.tensor([pps["c"].prompt_ids])
    assert processor.apply_chat_template([{"role": "user", "content": "Say something."}])["input_ids"].tolist() == ids.tolist()
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW)
    assert out["c"] == ref[0, ids.shape[1]:].tolist()


def test_chunked_prefill_ends_inside_the_audio(model_dir):
    pp = prompt(model_dir, [make_audio(40000, 16000, "wav", seed=6)])
    (start, length), = PromptBuilder(model_dir).family.image_spans(pp.prompt_ids)
    assert start < 64 < start + length  # a 64-token chunk ends inside the clip's run
    assert run(new_engine(model_dir, max_num_batched_tokens=64), {"r": pp})["r"] == hf_generate(model_dir, pp)


def test_prefix_cache_hit_skips_the_encode(model_dir):
    """A second turn resending the first turn's clip: its placeholders are in the cached prefix, so the clip is
    not encoded again, and the tokens are still HF's."""
    builder = PromptBuilder(model_dir)
    first = prompt(model_dir, [make_audio(32000, 16000, "wav", seed=7)])
    engine = new_engine(model_dir)
    reply = run(engine, {"t1": first})["t1"]
    follow = builder.tokenizer.encode(" And again?", add_special_tokens=False)
    second_ids = first.prompt_ids + reply + follow
    engine.add_request("t2", second_ids, images=first.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    got = engine.run_until_done()["t2"]
    assert engine.counters["encoded_images"] == 1 and engine.counters["encodes_skipped_by_prefix"] == 1

    model, _ = _reference(model_dir)
    features = processor_inputs(model_dir, first)["input_features"]
    ids = torch.tensor([second_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=features,
                             do_sample=False, max_new_tokens=MAX_NEW)
    assert got == out[0, ids.shape[1]:].tolist()
