"""Llama 4's text model on the paged engine: chunked local attention on its RoPE layers, a global NoPE layer
with temperature tuning, the qk L2 norm, and sigmoid-routed experts beside a shared expert. HF generate
(float32) is the oracle for a ragged batch prefilled in chunks that end inside attention chunks, a prefix
hit that resumes inside one, and preemption; each trait, ignored by the engine, moves the tokens off HF's.
Its images are refused (common/families/llama4.py): the image processor needs torchvision."""

from __future__ import annotations

import pytest
import torch

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.admission import AdmissionError, Limits, admit
from mserve.workers import text_traits
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_frames, make_image

MAX_NEW = 14  # decode crosses an attention chunk's end (12) in every prompt
CHUNK = 12
RAGGED = (1, 3, 0)  # three prompts of 41, 17 and 24 tokens


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama4"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def engine(model_dir: str, **config) -> Engine:
    return Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 128, "block_size": 16, **config}))


def sampling(i: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW + i, ignore_eos=True)


def expected(model_dir: str, prompt_ids, i: int = 0) -> list[int]:
    return hf_generate(model_dir, prompt_ids, [], MAX_NEW + i, ignore_eos=True)


def ragged(model_dir: str, builder, e: Engine | None = None, which=RAGGED) -> dict[str, tuple[list[int], list[int]]]:
    """(engine's tokens, HF's) of prompts `which` in one engine, 8-token prefill chunks (not a multiple of the
    12-token attention chunk: chunks of the prompt end inside attention chunks) beside decode tokens."""
    e = e or engine(model_dir, max_num_batched_tokens=8)
    prompts = {f"p{k}": builder.prepare_text(PROMPTS[k]).prompt_ids for k in which}
    for i, (rid, ids) in enumerate(prompts.items()):
        e.add_request(rid, ids, sampling=sampling(i))
    out = e.run_until_done()
    assert len(which) == 1 or e.counters["steps"] < sum(len(v) for v in out.values())  # they did share steps
    return {rid: (out[rid], expected(model_dir, ids, i)) for i, (rid, ids) in enumerate(prompts.items())}


def test_the_tiny_model_turns_every_trait_on(model_dir, builder):
    e = engine(model_dir)
    text = e.runner.model.config.text_config
    assert text.layer_types == ["chunked_attention"] * 3 + ["full_attention"] and text.no_rope_layers == [1, 1, 1, 0]
    assert text.attention_chunk_size == CHUNK and CHUNK % 8 and 16 % CHUNK  # not a prefill chunk's or a block's size
    assert min(len(builder.prepare_text(PROMPTS[k]).prompt_ids) for k in RAGGED) > CHUNK
    assert e.runner.attention_chunks == [CHUNK] * 3 + [None] and e.runner.kv.owned == [0, 1, 2, 3]
    assert text.use_qk_norm and text.attn_temperature_tuning and text.floor_scale == 4
    assert text.moe_layers == [1, 3] and text.num_experts_per_tok == 2 and text.num_local_experts == 8
    wrapped = [layer.self_attn for layer in e.runner.language_model.layers]
    assert [type(m).__name__ for m in wrapped] == ["Llama4TextAttention"] * 3 + ["TemperatureAtPositions"]


def test_reduced_precision_is_refused_at_load_and_never_the_default(model_dir):
    from mserve.common.processor import UnsupportedModelError
    from mserve.common.serving_defaults import serving_dtype_for

    assert serving_dtype_for("cuda", None, model_dir) == "float32"
    with pytest.raises(UnsupportedModelError, match=r"model_type 'llama4' in bfloat16: .* serve it in float32"):
        engine(model_dir, dtype="bfloat16")


def test_ragged_batch_in_prefill_chunks_matches_hf(model_dir, builder):
    for rid, (got, want) in ragged(model_dir, builder).items():
        assert got == want, rid


def _no_chunks(e):
    e.runner.attention_chunks = None


def _chunk_one_longer(e):
    e.runner.attention_chunks = [c and c + 1 for c in e.runner.attention_chunks]


def _temperature_at_packed_index(e):  # HF's own scaling, by index in the packed step
    for layer in e.runner.language_model.layers:
        if isinstance(layer.self_attn, text_traits.TemperatureAtPositions):
            layer.self_attn = layer.self_attn.inner


def _no_qk_norm(e):
    for layer in e.runner.language_model.layers:
        if hasattr(layer.self_attn, "qk_norm"):
            del layer.self_attn.qk_norm


def _softmax_router(e):
    def route(router, hidden):
        logits = torch.nn.functional.linear(hidden, router.weight)
        top, index = torch.topk(logits, router.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.softmax(scores, dim=1), logits

    for m in e.runner.model.modules():
        if type(m).__name__ == "Llama4Router":
            m.forward = route.__get__(m)


def _no_shared_expert(e):
    for m in e.runner.model.modules():
        if type(m).__name__ == "Llama4TextMoe":
            m.shared_expert.forward = torch.zeros_like


@pytest.mark.parametrize("shortcut", [_no_chunks, _chunk_one_longer, _temperature_at_packed_index, _no_qk_norm,
                                      _softmax_router, _no_shared_expert],
                         ids=["chunks_ignored", "chunk_one_longer", "temperature_at_packed_index", "no_qk_norm",
                              "softmax_router", "shared_expert_dropped"])
def test_each_trait_ignored_moves_the_tokens_off_hf(model_dir, builder, shortcut):
    """Not vacuous: the engine with one trait ignored, on the longest prompt prefilled in the same chunks,
    answers other tokens than HF's."""
    e = engine(model_dir, max_num_batched_tokens=8)
    shortcut(e)
    (got, want), = ragged(model_dir, builder, e, which=RAGGED[:1]).values()
    assert got != want


def test_prefix_hit_resumes_inside_an_attention_chunk(model_dir, builder):
    """A repeated prompt and a second turn reuse whole 16-token blocks: the computed rest starts at 16, 32 or
    48, inside attention chunks, and attends to the cached keys of its chunk."""
    e = engine(model_dir)
    pp = builder.prepare_text(PROMPTS[1])
    want = expected(model_dir, pp.prompt_ids)
    boundary = (len(pp.prompt_ids) - 1) // 16 * 16
    assert boundary % CHUNK
    for rid, cached in (("first", 0), ("again", boundary)):
        seq = e.add_request(rid, pp.prompt_ids, sampling=sampling())
        assert e.run_until_done()[rid] == want
        assert seq.num_cached_tokens == cached
    ids = pp.prompt_ids + want + builder.prepare_text(PROMPTS[3]).prompt_ids[1:]
    seq = e.add_request("turn2", ids, sampling=sampling())
    assert e.run_until_done()["turn2"] == expected(model_dir, ids)
    assert seq.num_cached_tokens >= boundary


def test_preempted_requests_recompute_exactly(model_dir, builder):
    """Room for two prompts and a spare block: decode growth preempts, the victim recomputes from its first token."""
    prompts = {f"r{k}": builder.prepare_text(PROMPTS[k]).prompt_ids for k in RAGGED}
    longest = max(len(ids) for ids in prompts.values())
    e = engine(model_dir, num_blocks=2 * -(-longest // 16) + 1, reserve_tokens=0)
    e.scheduler.clock = lambda: 0.0  # prompt aging on wall time could reorder admissions so none is needed
    for rid, ids in prompts.items():
        e.add_request(rid, ids, sampling=sampling())
    out = e.run_until_done()
    assert e.scheduler.num_preemptions > 0
    for rid, ids in prompts.items():
        assert out[rid] == expected(model_dir, ids), rid


def test_text_served_images_and_videos_refused_at_admission(model_dir, builder):
    """The processor is built without Llama4ImageProcessor (torchvision only): its tokenizer and chat template
    serve text; an image or a video part is a bad request naming the model and the reason."""
    assert builder.family.processor.image_processor is None and builder.family.modalities == ["text"]
    payload = {"request_id": "r", "model": "tiny-llama4", "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPTS[0]}]}]}
    assert admit(builder, Limits(), payload).prompt_ids == builder.prepare_text(PROMPTS[0]).prompt_ids
    for part in ({"type": "image", "image": make_image(40, 30)}, {"type": "video", "video": make_frames(56, 56, 2)}):
        payload["messages"][0]["content"].insert(0, part)
        with pytest.raises(AdmissionError, match=r"(image|video) 0: .*model_type llama4 is served for text only: "
                                                 r"its image processor \(Llama4ImageProcessor\) needs torchvision") as err:
            admit(builder, Limits(), payload)
        assert err.value.code == "bad_request"
        payload["messages"][0]["content"].pop(0)
    with pytest.raises(ValueError, match="torchvision"):  # the engine-side builder refuses it too
        builder.prepare_text(PROMPTS[0], [make_image(40, 30)])


def test_tiny_model_folder_loads_as_published_with_its_image_processor_settings(model_dir):
    """`mserve make-tiny-model --arch llama4`: transformers' own classes load it; the image processor's settings
    are saved (in both layouts) though its class, torchvision-only, cannot be built here."""
    import json
    from pathlib import Path

    from transformers import AutoProcessor, AutoTokenizer

    folder = Path(model_dir)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]
    nested = json.loads((folder / "processor_config.json").read_text())
    assert nested["processor_class"] == "Llama4Processor"
    assert nested["image_processor"] == json.loads((folder / "preprocessor_config.json").read_text())
    assert nested["image_processor"]["image_processor_type"] == "Llama4ImageProcessor"
    with pytest.raises(ValueError, match="Missing optional dependencies: torchvision"):
        AutoProcessor.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[3]}], add_generation_prompt=True, tokenize=False)
    assert text == "<|begin_of_text|><|header_start|>user<|header_end|>\n\nHi<|eot|><|header_start|>assistant<|header_end|>\n\n"

