"""Audio clips through the engine give exactly Hugging Face generate()'s greedy tokens: Qwen2-Audio, Voxtral and
Gemma 4 (its clips beside images).

The prompt is mserve's (PromptBuilder: each clip's token count from its container header); HF gets the same
turn through the family's own processor and the waveforms the engine decodes (tests/audio_references.py), whose
ids must equal mserve's prompt ids. So these check the model path: the audio towers and projectors
(workers/audio_encoding.py), the placeholder scatter, chunked prefill (Gemma 4: audio causal, images whole) and
the prefix cache. Each family's checkpoint is built once a session (conftest.py), its weights loaded once for all
its float32 engines (an engine only reads its model; each test still gets a fresh engine, since every test counts
its own encodes and prefix hits), and each HF reference runs once however many tests ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.audio_clips import make_audio
from tests.audio_references import (MAX_NEW, gemma4_inputs, generate, hf_generate_audio, qwen2_audio_features,
                                    qwen2_audio_inputs, voxtral_inputs)
from tests.helpers import make_image
from tests.workers.test_engine_gemma3 import recorded_chunks
from tests.workers.test_engine_oracle import whole_model


def audio(samples: int, rate: int, fmt: str, seed: int) -> tuple[str, bytes]:
    return "audio", make_audio(samples, rate, fmt, seed=seed)


def image(width: int, height: int, seed: int) -> tuple[str, bytes]:
    return "image", make_image(width, height, seed=seed)


@dataclass(frozen=True)
class Spec:
    """A family's prompts: each test's clips (and images), the token runs admission gives them, its engine."""

    text: str
    engine: dict
    two: list  # several clips (Gemma 4: an image between them) in one prompt
    two_runs: list[int]
    ragged_a: list  # one of the ragged batch is `chunked`'s prompt: its HF reference runs once for both
    ragged_b: list
    ragged_b_text: str
    chunk: int  # prefill chunk that ends inside the clip of `chunked`
    chunked: list
    prefix_seed: int


SPECS = {
    "qwen2_audio": Spec("What is this sound?", {"num_blocks": 64},
                        [audio(16000, 16000, "wav", 2), audio(30000, 44100, "flac", 3)], [25, 17],
                        [audio(40000, 16000, "wav", 6)], [audio(47000, 48000, "ogg", 5)], "Describe it.",
                        16, [audio(40000, 16000, "wav", 6)], 7),
    # 30 s chunks: 0.1 s to 30 s is 375 tokens, 31 s two chunks
    "voxtral": Spec("What is this sound?", {"num_blocks": 128},
                    [audio(16000, 16000, "wav", 2), audio(496000, 16000, "wav", 3)], [375, 750],
                    [audio(40000, 16000, "wav", 6)], [audio(47000, 48000, "ogg", 5)], "Describe it.",
                    64, [audio(40000, 16000, "wav", 6)], 7),
    "gemma4": Spec("What do you hear and see?", {"num_blocks": 512, "max_num_batched_tokens": 4096},
                   [audio(16000, 16000, "wav", 2), image(120, 90, 3), audio(30000, 44100, "flac", 4)], [25, 63, 17],
                   [audio(8000, 16000, "wav", 5)], [image(100, 80, 8), audio(40000, 16000, "wav", 9)],
                   "What do you hear and see?", 16, [image(100, 80, 8), audio(40000, 16000, "wav", 9)], 10),
}


@dataclass(frozen=True)
class Family:
    arch: str
    model_dir: str
    builder: PromptBuilder
    spec: Spec

    def engine(self, **overrides) -> Engine:
        cfg = {"dtype": "float32", "block_size": 16, **self.spec.engine, **overrides}
        return Engine(EngineConfig(self.model_dir, **cfg), model=None if "dtype" in overrides else whole_model(self.model_dir))

    def prompt(self, parts: list, text: str | None = None):
        content = [{"type": kind, kind: data} for kind, data in parts] + [{"type": "text", "text": text or self.spec.text}]
        return self.builder.prepare([{"role": "user", "content": content}])

    def inputs(self, pp, text: str | None = None):
        if self.arch == "qwen2_audio":
            return qwen2_audio_inputs(self.model_dir, pp)
        if self.arch == "voxtral":
            return voxtral_inputs(self.model_dir, pp, text or self.spec.text)
        return gemma4_inputs(self.builder, pp)

    def reference(self, pp, text: str | None = None) -> list[int]:
        return generate(self.model_dir, self.inputs(pp, text)).ids

    def second_turn_reference(self, first, ids: list[int]) -> list[int]:
        """HF on a second turn's ids (the first turn, its reply, more text) with the first turn's clip."""
        ids = torch.tensor([ids])
        turn = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.arch == "qwen2_audio":
            return generate(self.model_dir, {**turn, **qwen2_audio_features(self.model_dir, first)}).ids
        features = self.inputs(first)
        if self.arch == "voxtral":
            return generate(self.model_dir, {**turn, "input_features": features["input_features"]}).ids
        return generate(self.model_dir, {**features, **turn, "mm_token_type_ids": torch.zeros_like(ids)}).ids


@lru_cache(maxsize=None)
def family_of(arch: str, model_dir: str) -> Family:
    return Family(arch, model_dir, PromptBuilder(model_dir), SPECS[arch])


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tiny_model_dirs) -> Family:
    return family_of(request.param, str(tiny_model_dirs[request.param]))


def run(engine: Engine, requests: dict) -> dict[str, list[int]]:
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()
    engine.pool.check_integrity()
    return out


def test_one_clip(family):
    pp = family.prompt([audio(20000, 22050, "mp3", 1)])
    engine = family.engine()
    expected = family.reference(pp)
    assert run(engine, {"r": pp})["r"] == expected
    assert engine.counters["encoded_images"] == 1 and engine.pool.num_used_blocks == 0
    # Not vacuous: another clip of the same length and format gives the tiny model other tokens.
    assert family.reference(family.prompt([audio(20000, 22050, "mp3", 9)])) != expected


def test_two_clips_in_one_prompt(family):
    """Clips of different lengths in one prompt (Gemma 4: clip, image, clip: one encode batch mixes a waveform
    and an image)."""
    pp = family.prompt(family.spec.two)
    fam = family.builder.family
    runs = fam.image_spans(pp.prompt_ids)
    assert [n for _, n in runs] == family.spec.two_runs
    token = {"audio": fam.audio_token_id, "image": getattr(fam, "image_token_id", None)}
    assert [pp.prompt_ids[s] for s, _ in runs] == [token[kind] for kind, _ in family.spec.two]
    assert run(family.engine(), {"r": pp})["r"] == family.reference(pp)


def test_ragged_batch(family):
    """Two clips of different lengths (Gemma 4: one beside an image) and a request without audio in one batch."""
    spec = family.spec
    pps = {"a": family.prompt(spec.ragged_a), "b": family.prompt(spec.ragged_b, spec.ragged_b_text),
           "c": family.builder.prepare([{"role": "user", "content": "Say something."}])}
    texts = {"a": spec.text, "b": spec.ragged_b_text, "c": "Say something."}
    out = run(family.engine(), pps)
    for rid, pp in pps.items():
        assert out[rid] == family.reference(pp, texts[rid]), rid


def test_chunked_prefill_ends_inside_the_audio(family):
    """Prefill chunks of `chunk` tokens: one ends inside the clip (its tokens attend causally), none inside an
    image (Gemma 4 keeps images whole)."""
    pp = family.prompt(family.spec.chunked)
    fam = family.builder.family
    runs = fam.image_spans(pp.prompt_ids)
    engine = family.engine(max_num_batched_tokens=family.spec.chunk)
    chunks = recorded_chunks(engine)
    assert run(engine, {"r": pp})["r"] == family.reference(pp)
    ends = [end for _, _, end in chunks]
    inside = {kind: any(s < end < s + n for s, n in runs if pp.prompt_ids[s] == token for end in ends)
              for kind, token in (("audio", fam.audio_token_id), ("image", getattr(fam, "image_token_id", None)))}
    assert inside == {"audio": True, "image": False}


def test_prefix_cache_hit_skips_the_encode(family):
    """A second turn resending the first turn's clip: its placeholders are in the cached prefix, so the clip is
    not encoded again, and the tokens are still HF's."""
    first = family.prompt([audio(32000, 16000, "wav", family.spec.prefix_seed)])
    engine = family.engine()
    reply = run(engine, {"t1": first})["t1"]
    second_ids = first.prompt_ids + reply + family.builder.tokenizer.encode(" And again?", add_special_tokens=False)
    engine.add_request("t2", second_ids, images=first.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    got = engine.run_until_done()["t2"]
    assert engine.counters["encoded_images"] == 1 and engine.counters["encodes_skipped_by_prefix"] == 1
    assert got == family.second_turn_reference(first, second_ids)


# ---- one family's own checks -------------------------------------------------------------------------------


def test_generate_cli_takes_audio(tiny_model_dirs, tmp_path):
    """Qwen2-Audio: `mserve generate --audio PATH --json` as a user runs it: HF's tokens; a bad clip is a clear
    error."""
    import json

    from mserve.cli import build_parser
    from tests.workers.test_generate_cli import run_cli

    model_dir = str(tiny_model_dirs["qwen2_audio"])
    clip = tmp_path / "clip.flac"
    clip.write_bytes(make_audio(24000, 44100, "flac", seed=8))
    res = run_cli("generate", "--model", model_dir, "--prompt", "What is this sound?", "--audio", str(clip),
                  "--max-tokens", str(MAX_NEW), "--json", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    pp = PromptBuilder(model_dir).prepare_text("What is this sound?", audio=[clip.read_bytes()])
    assert out["prompt_token_ids"] == pp.prompt_ids and out["token_ids"] == hf_generate_audio(model_dir, pp)

    clip.write_bytes(clip.read_bytes()[:100])  # refused before any engine loads: run in this process
    args = build_parser().parse_args(["generate", "--model", model_dir, "--prompt", "?", "--audio", str(clip)])
    with pytest.raises(SystemExit, match="error: cannot read the audio container"):
        args.func(args)


@pytest.mark.parametrize("samples, rate, fmt", [(1600, 16000, "wav"), (480000, 16000, "wav"), (1323000, 44100, "flac"),
                                                (1323441, 44100, "wav"), (50000, 22050, "mp3")])
def test_voxtral_admission_count_is_the_processors(tiny_model_dirs, samples, rate, fmt):
    """0.1 s, exactly 30 s (at 16 kHz and resampled from 44.1 kHz), just over 30 s, an mp3: one chunk or two."""
    vox = family_of("voxtral", str(tiny_model_dirs["voxtral"]))
    pp = vox.prompt([audio(samples, rate, fmt, 1)])
    assert vox.inputs(pp)["input_ids"][0].tolist() == pp.prompt_ids
    assert pp.prompt_ids.count(vox.builder.family.audio_token_id) in (375, 750)


def test_gemma4_hf_reference_depends_on_audio_being_causal(tiny_model_dirs):
    """The oracle sees the audio mask: marked as an image in mm_token_type_ids (bidirectional on the sliding
    layers), the clip's tokens change HF's greedy tokens on the chunked test's prompt."""
    gemma = family_of("gemma4", str(tiny_model_dirs["gemma4"]))
    inputs = gemma.inputs(gemma.prompt(gemma.spec.chunked))
    types = inputs["mm_token_type_ids"]
    assert set(types[inputs["input_ids"] == gemma.builder.family.audio_token_id].tolist()) == {3}  # not grouped by HF
    expected = generate(gemma.model_dir, inputs).ids
    assert generate(gemma.model_dir, {**inputs, "mm_token_type_ids": torch.where(types == 3, 1, types)}).ids != expected


@pytest.mark.parametrize("exact", [True, None], ids=["exact_attention", "padded_default"])
def test_gemma4_bf16_two_clips_beside_an_image_match_hf_bf16(tiny_model_dirs, exact):
    """bfloat16, as Gemma 4's image path is served (test_engine_gemma4.py): with exact attention HF bf16's ids;
    padded, HF bf16's up to HF's first top-2 tie (common/exactness.py)."""
    from mserve.common.exactness import compare_greedy

    gemma = family_of("gemma4", str(tiny_model_dirs["gemma4"]))
    pp = gemma.prompt(gemma.spec.two)
    got = run(gemma.engine(dtype="bfloat16", exact_attention=exact), {"two": pp})["two"]
    want = generate(gemma.model_dir, gemma.inputs(pp), dtype="bfloat16")
    verdict = compare_greedy(want.ids, got, want.top2, "bfloat16")
    assert (got == want.ids) if exact else verdict.exact, verdict.describe()
    assert verdict.compared >= 8  # not vacuous: the two-clip prompt is compared over 8 steps before its first tie
