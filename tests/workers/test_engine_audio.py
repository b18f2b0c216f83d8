"""Audio clips through the engine give exactly Hugging Face generate()'s greedy tokens (Qwen2-Audio).

The prompt is mserve's (PromptBuilder: the clip's token count from its container header); HF gets the
same rendered text through Qwen2AudioProcessor (whose expansion must equal mserve's prompt ids) and the
waveforms the engine decodes (common/audio.py: decode_audio, checked against the processor's count in
tests/common/test_audio.py), so these tests check the model path: the audio tower and projector
(workers/audio_encoding.py), the placeholder scatter, chunked prefill and the prefix cache.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from mserve.common.audio import decode_audio
from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.audio_clips import make_audio

MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen2_audio"])


@lru_cache(maxsize=2)
def _reference(model_dir: str):
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    model = AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_generate_audio(model_dir: str, pp, max_new: int = MAX_NEW) -> list[int]:
    """HF generate on the processor's own inputs for pp's rendered text and clips; its ids must be pp's."""
    model, processor = _reference(model_dir)
    rate = processor.feature_extractor.sampling_rate
    clips = [decode_audio(part.data, rate, part.samples) for part in pp.images]
    inputs = processor(text=pp.text, audio=clips or None, sampling_rate=rate, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == pp.prompt_ids  # admission's count is the processor's
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def new_engine(model_dir: str, **overrides) -> Engine:
    return Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 64, "block_size": 16, **overrides}))


def prompt(model_dir: str, clips: list[bytes], text: str = "What is this sound?"):
    content = [{"type": "audio", "audio": c} for c in clips] + [{"type": "text", "text": text}]
    return PromptBuilder(model_dir).prepare([{"role": "user", "content": content}])


def run(engine: Engine, requests: dict) -> dict[str, list[int]]:
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()
    engine.pool.check_integrity()
    return out


def test_one_clip(model_dir):
    pp = prompt(model_dir, [make_audio(20000, 22050, "mp3", seed=1)])
    engine = new_engine(model_dir)
    expected = hf_generate_audio(model_dir, pp)
    assert run(engine, {"r": pp})["r"] == expected
    assert engine.counters["encoded_images"] == 1 and engine.pool.num_used_blocks == 0
    # Not vacuous: another clip of the same length and format gives the tiny model other tokens.
    assert hf_generate_audio(model_dir, prompt(model_dir, [make_audio(20000, 22050, "mp3", seed=9)])) != expected


def test_two_clips_in_one_prompt(model_dir):
    pp = prompt(model_dir, [make_audio(16000, 16000, "wav", seed=2), make_audio(30000, 44100, "flac", seed=3)])
    runs = PromptBuilder(model_dir).family.image_spans(pp.prompt_ids)
    assert [n for _, n in runs] == [25, 17]
    assert run(new_engine(model_dir), {"r": pp})["r"] == hf_generate_audio(model_dir, pp)


def test_ragged_batch(model_dir):
    """Three requests of different clip lengths (and one without audio) in one batch."""
    pps = {"a": prompt(model_dir, [make_audio(8000, 16000, "wav", seed=4)]),
           "b": prompt(model_dir, [make_audio(47000, 48000, "ogg", seed=5)], "Describe it."),
           "c": PromptBuilder(model_dir).prepare([{"role": "user", "content": "Say something."}])}
    out = run(new_engine(model_dir), pps)
    for rid, pp in pps.items():
        assert out[rid] == hf_generate_audio(model_dir, pp), rid


def test_chunked_prefill_ends_inside_the_audio(model_dir):
    pp = prompt(model_dir, [make_audio(40000, 16000, "wav", seed=6)])
    (start, length), = PromptBuilder(model_dir).family.image_spans(pp.prompt_ids)
    assert start % 16 < 16 < length  # a 16-token chunk ends inside the clip's run
    assert run(new_engine(model_dir, max_num_batched_tokens=16), {"r": pp})["r"] == hf_generate_audio(model_dir, pp)


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

    model, processor = _reference(model_dir)
    rate = processor.feature_extractor.sampling_rate
    features = processor.feature_extractor([decode_audio(first.images[0].data, rate, first.images[0].samples)],
                                           sampling_rate=rate, padding="max_length", return_attention_mask=True,
                                           return_tensors="pt")
    ids = torch.tensor([second_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=features["input_features"],
                             feature_attention_mask=features["attention_mask"], do_sample=False, max_new_tokens=MAX_NEW)
    assert got == out[0, ids.shape[1]:].tolist()


def test_generate_cli_takes_audio(model_dir, tmp_path):
    """`mserve generate --audio PATH --json` as a user runs it: HF's tokens; a bad clip is a clear error."""
    import json

    from tests.workers.test_generate_cli import run_cli

    clip = tmp_path / "clip.flac"
    clip.write_bytes(make_audio(24000, 44100, "flac", seed=8))
    res = run_cli("generate", "--model", model_dir, "--prompt", "What is this sound?", "--audio", str(clip),
                  "--max-tokens", str(MAX_NEW), "--json", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    pp = PromptBuilder(model_dir).prepare_text("What is this sound?", audio=[clip.read_bytes()])
    assert out["prompt_token_ids"] == pp.prompt_ids and out["token_ids"] == hf_generate_audio(model_dir, pp)
    from mserve.cli import build_parser

    clip.write_bytes(clip.read_bytes()[:100])  # refused before any engine loads: run in this process
    args = build_parser().parse_args(["generate", "--model", model_dir, "--prompt", "?", "--audio", str(clip)])
    with pytest.raises(SystemExit, match="error: cannot read the audio container"):
        args.func(args)
