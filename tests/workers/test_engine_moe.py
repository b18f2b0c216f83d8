"""Mixture-of-experts text models run as the checkpoint's own layers: every routed expert counts (HF generate is the oracle).

The engine calls the checkpoint's decoder layers in one packed forward, so its routers and experts are
transformers' own. These tests pin that the tiny checkpoint makes routing matter: its tokens spread over
the experts, each takes more than one expert with real weight, and a top-1 shortcut (one expert per
token, as a fast path might take) changes HF's greedy tokens, while the engine, chunked through an image
and batched with other prompts, keeps HF's.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, _hf_generate, hf_generate, make_image, reference_model

MAX_NEW = 10
MOE_ARCHS = ["qwen3_vl_moe", "glm4v_moe", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def routers(model) -> list[torch.nn.Module]:
    """The text model's top-k routers (one per sparse decoder layer)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]


@contextlib.contextmanager
def top1_routing(model_dir: str):
    """HF's own model with every router choosing one expert per token (its weight renormalised to 1)."""
    found = routers(reference_model(model_dir)[0])
    chosen = [r.top_k for r in found]
    for r in found:
        r.top_k = 1
    try:
        yield
    finally:
        for r, k in zip(found, chosen):
            r.top_k = k


def test_tokens_spread_over_the_experts_with_several_per_token(model_dir, builder):
    model = reference_model(model_dir)[0]
    text = model.config.text_config
    num_experts = getattr(text, "num_experts", None) or text.n_routed_experts
    assert text.num_experts_per_tok >= 2 and num_experts >= 4 * text.num_experts_per_tok
    picks = []
    hooks = [r.register_forward_hook(lambda m, args, out: picks.append(out)) for r in routers(model)]
    # every layer sparse but GLM's first (dense, as published); GLM adds a shared expert beside the routed ones
    assert len(hooks) == text.num_hidden_layers - getattr(text, "first_k_dense_replace", 0) >= 2
    assert getattr(text, "n_shared_experts", 1) == 1
    pp = builder.prepare_text(PROMPTS[1], [make_image(200, 120, seed=2)])
    try:
        list(_hf_generate.__wrapped__(model_dir, tuple(pp.prompt_ids), tuple(pp.images), 1, False)[0])
    finally:
        for h in hooks:
            h.remove()
    for _, weights, experts in picks:
        assert len(set(experts.flatten().tolist())) >= num_experts // 2  # routing varies per token
        second = weights.sort(dim=-1, descending=True).values[:, 1]
        assert second.mean() > 0.2  # the second expert carries real weight


def test_top1_shortcut_changes_the_tokens_and_the_engine_keeps_every_expert(model_dir, builder):
    image = make_image(200, 120, seed=2)
    pp = builder.prepare_text(PROMPTS[1], [image])
    text = builder.prepare_text(PROMPTS[4])
    expected = hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW)
    with top1_routing(model_dir):  # hf_generate caches by its inputs: the uncached function here
        shortcut = list(_hf_generate.__wrapped__(model_dir, tuple(pp.prompt_ids), tuple(pp.images), MAX_NEW, False)[0])
    assert shortcut != expected  # not vacuous: the second expert moves this prompt's greedy tokens
    (start, length), = builder.family.image_spans(pp.prompt_ids)
    assert start % 8 and length > 8  # 8-token chunks start and end inside the image
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=128, block_size=16, max_num_batched_tokens=8))
    for rid, p in (("image", pp), ("text", text)):  # one packed forward routes both prompts' tokens
        engine.add_request(rid, p.prompt_ids, images=p.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()
    assert out["image"] == expected
    assert out["text"] == hf_generate(model_dir, text.prompt_ids, [], MAX_NEW)


def test_glm46v_class_over_per_expert_weights_is_refused_at_load(tiny_model_dirs, tmp_path):
    """GLM-4.6V's config over GLM-4.5-Air's MoE text model, its experts saved one by one as transformers saves
    them: Glm46VModel builds the MoE text model (AutoModel on text_config), but transformers fuses per-expert
    weights only for glm4v_moe's model_type, so it leaves the experts newly initialized, different on every
    load (HF's own generate with them). The engine refuses to load it, naming the weights."""
    from mserve.common.processor import UnsupportedModelError
    from mserve.workers.model_loading import load_vlm

    folder = tmp_path / "glm46v-over-moe"
    shutil.copytree(tiny_model_dirs["glm4v_moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="glm46v", architectures=["Glm46VForConditionalGeneration"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"transformers leaves 4 weights of Glm46VForConditionalGeneration "
                                                    r"unloaded \(newly initialized\), e\.g\. model\.language_model\.layers\.1\.mlp\.experts"):
        load_vlm(folder)
