"""Gemma 4's audio through the engine, beside its images: exactly HF generate's greedy tokens.

The prompt is mserve's (PromptBuilder: each clip's count from its container header, boa + soft tokens + eoa);
HF gets the same rendered text, images and decoded clips through Gemma4Processor, whose ids must be mserve's
and whose inputs (pixels, log-mel features, mm_token_type_ids) go to generate as they are. Images stay
bidirectional on the sliding layers; audio soft tokens attend causally, as HF's mask has them
(test_hf_reference_depends_on_audio_being_causal shows the oracle sees the difference).
"""

from __future__ import annotations

import io

import pytest
import torch

from mserve.common.audio import decode_audio
from mserve.common.prompt import PromptBuilder
from mserve.workers.sequence import SamplingParams
from tests.audio_clips import make_audio
from tests.helpers import make_image, reference_model
from tests.workers.test_engine_audio import MAX_NEW, run
from tests.workers.test_engine_gemma3 import recorded_chunks
from tests.workers.test_engine_oracle import new_engine


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["gemma4"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def prompt(builder: PromptBuilder, parts: list, text: str = "What do you hear and see?"):
    """`parts`: ("audio" | "image", bytes) in prompt order, then the text."""
    content = [{"type": kind, kind: data} for kind, data in parts] + [{"type": "text", "text": text}]
    return builder.prepare([{"role": "user", "content": content}])


def hf_inputs(builder: PromptBuilder, pp) -> dict:
    """Gemma4Processor's own inputs for pp's rendered text, images and clips (its ids must be pp's)."""
    from PIL import Image

    processor = builder.family.processor
    rate = processor.feature_extractor.sampling_rate
    clips = [decode_audio(p.data, rate, p.samples) for p in pp.images if not isinstance(p, bytes)]
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pp.images if isinstance(p, bytes)]
    inputs = processor(text=pp.text, images=images or None, audio=clips or None, add_special_tokens=False,
                       return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == pp.prompt_ids  # admission's counts are the processor's
    return inputs


def hf_generate(model_dir: str, inputs: dict) -> list[int]:
    model, _ = reference_model(model_dir)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_one_clip(model_dir, builder):
    pp = prompt(builder, [("audio", make_audio(20000, 22050, "mp3", seed=1))])
    engine = new_engine(model_dir)
    expected = hf_generate(model_dir, hf_inputs(builder, pp))
    assert run(engine, {"r": pp})["r"] == expected
    assert engine.counters["encoded_images"] == 1 and engine.pool.num_used_blocks == 0
    # Not vacuous: another clip of the same length and format gives the tiny model other tokens.
    other = prompt(builder, [("audio", make_audio(20000, 22050, "mp3", seed=9))])
    assert hf_generate(model_dir, hf_inputs(builder, other)) != expected


def test_two_clips_and_an_image_in_one_request(model_dir, builder):
    """Clip, image, clip and text in one prompt: one encode batch mixes a waveform and an image."""
    pp = prompt(builder, [("audio", make_audio(16000, 16000, "wav", seed=2)), ("image", make_image(120, 90, seed=3)),
                          ("audio", make_audio(30000, 44100, "flac", seed=4))])
    family = builder.family
    runs = family.image_spans(pp.prompt_ids)
    assert [n for _, n in runs] == [25, 63, 17]  # 1 s, the image, 0.68 s
    kinds = [pp.prompt_ids[s] for s, _ in runs]
    assert kinds == [family.audio_token_id, family.image_token_id, family.audio_token_id]
    assert run(new_engine(model_dir), {"r": pp})["r"] == hf_generate(model_dir, hf_inputs(builder, pp))


def test_ragged_batch(model_dir, builder):
    """A clip, an image with a clip, and text alone, in one batch."""
    pps = {"a": prompt(builder, [("audio", make_audio(8000, 16000, "wav", seed=5))]),
           "b": prompt(builder, [("image", make_image(90, 150, seed=6)),
                                 ("audio", make_audio(47000, 48000, "ogg", seed=7))], "Describe both."),
           "c": builder.prepare([{"role": "user", "content": "Say something."}])}
    out = run(new_engine(model_dir), pps)
    for rid, pp in pps.items():
        assert out[rid] == hf_generate(model_dir, hf_inputs(builder, pp)), rid


def test_chunked_prefill_ends_inside_the_audio(model_dir, builder):
    """16-token chunks: one ends inside the clip (its tokens attend causally), none inside the image."""
    pp = prompt(builder, [("image", make_image(100, 80, seed=8)), ("audio", make_audio(40000, 16000, "wav", seed=9))])
    (i_start, i_len), (a_start, a_len) = builder.family.image_spans(pp.prompt_ids)
    engine = new_engine(model_dir, max_num_batched_tokens=16)
    chunks = recorded_chunks(engine)
    assert run(engine, {"r": pp})["r"] == hf_generate(model_dir, hf_inputs(builder, pp))
    ends = [end for _, _, end in chunks]
    assert any(a_start < end < a_start + a_len for end in ends)
    assert not any(i_start < end < i_start + i_len for end in ends)


def test_prefix_cache_hit_skips_the_encode(model_dir, builder):
    """A second turn resending the first turn's clip: its tokens are in the cached prefix, so it is not encoded
    again, and the tokens are still HF's."""
    first = prompt(builder, [("audio", make_audio(32000, 16000, "wav", seed=10))])
    engine = new_engine(model_dir)
    reply = run(engine, {"t1": first})["t1"]
    follow = builder.tokenizer.encode(" And again?", add_special_tokens=False)
    second_ids = first.prompt_ids + reply + follow
    engine.add_request("t2", second_ids, images=first.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    got = engine.run_until_done()["t2"]
    assert engine.counters["encoded_images"] == 1 and engine.counters["encodes_skipped_by_prefix"] == 1
    inputs = hf_inputs(builder, first)
    ids = torch.tensor([second_ids])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.zeros_like(ids))
    assert got == hf_generate(model_dir, inputs)


def test_hf_reference_depends_on_audio_being_causal(model_dir, builder):
    """The oracle sees the audio mask: marked as an image in mm_token_type_ids (bidirectional on the sliding
    layers), the clip's tokens change HF's greedy tokens on this prompt."""
    pp = prompt(builder, [("image", make_image(100, 80, seed=8)), ("audio", make_audio(40000, 16000, "wav", seed=9))])
    inputs = hf_inputs(builder, pp)
    types = inputs["mm_token_type_ids"]
    assert set(types[inputs["input_ids"] == builder.family.audio_token_id].tolist()) == {3}  # not grouped by HF
    expected = hf_generate(model_dir, inputs)
    assert hf_generate(model_dir, {**inputs, "mm_token_type_ids": torch.where(types == 3, 1, types)}) != expected


@pytest.mark.parametrize("exact", [True, None], ids=["exact_attention", "padded_default"])
def test_bf16_two_clips_beside_an_image_match_hf_bf16(model_dir, builder, exact):
    """bfloat16, as the image path is served (test_engine_gemma4.py): with exact attention HF bf16's ids; padded,
    HF bf16's up to HF's first top-2 tie (common/exactness.py)."""
    from mserve.common.exactness import compare_greedy

    pps = {"two": prompt(builder, [("audio", make_audio(16000, 16000, "wav", seed=2)),
                                   ("image", make_image(120, 90, seed=3)),
                                   ("audio", make_audio(30000, 44100, "flac", seed=4))])}
    engine = new_engine(model_dir, dtype="bfloat16", exact_attention=exact)
    out = run(engine, pps)
    model, _ = reference_model(model_dir, "bfloat16")
    compared = 0
    for rid, pp in pps.items():
        inputs = hf_inputs(builder, pp)
        with torch.inference_mode():
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, output_logits=True,
                                 return_dict_in_generate=True)
        want = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        top2 = [tuple(step[0].float().topk(2).values.tolist()) for step in gen.logits]
        verdict = compare_greedy(want, out[rid], top2, "bfloat16")
        assert (out[rid] == want) if exact else verdict.exact, f"{rid}: {verdict.describe()}"
        compared += verdict.compared
    assert compared >= 8  # not vacuous: the two-clip prompt is compared over 8 steps before its first tie
