"""Traits come from the checkpoint's config.json and its model's source: what the engine honours is
served, what it cannot is named in the refusal, never ignored."""

from __future__ import annotations

import json

import pytest

from mserve.common.model import load_family
from mserve.common.processor import UnsupportedModelError
from mserve.common.traits import read_traits
from tests.workers.untested_families import BUILDERS

# Families refused from config.json alone, with the words the refusal must hold.
REFUSED = {
    "qwen4_exp": "linear attention layers (Gated DeltaNet): not supported outside the tested Qwen3.5 families",
    "lfm2_vl": "short convolution layers (a recurrent conv state per sequence): not supported",
    "paligemma": "prefix-LM attention (bidirectional over the whole prompt, from token_type_ids): not supported",
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_an_unhonoured_trait_is_named_in_the_refusal_at_load(model_type, tiny_model_dirs):
    with pytest.raises(UnsupportedModelError) as info:
        load_family(tiny_model_dirs[model_type])
    message = str(info.value)
    assert message.startswith(f"model_type {model_type!r}: ") and REFUSED[model_type] in message
    assert "\n" not in message


def test_traits_read_from_config(tiny_model_dirs):
    sliding = read_traits(json.loads((tiny_model_dirs["llava_next_video"] / "config.json").read_text()))
    assert set(sliding.layer_types) == {"sliding_attention"} and sliding.sliding_window == 24
    assert sliding.unsupported() == []
    mrope = read_traits(json.loads((tiny_model_dirs["qwen2_vl"] / "config.json").read_text()))
    assert mrope.mrope and not mrope.token_type_mask and mrope.unsupported() == []
    gemma3 = read_traits(json.loads((tiny_model_dirs["gemma3"] / "config.json").read_text()))
    assert gemma3.token_type_mask and not gemma3.prefix_lm  # tested: its family module honours it
    llama4 = json.loads((tiny_model_dirs["llama4"] / "config.json").read_text())
    assert read_traits(llama4).attention_chunk_size == 12 and "chunked_attention" in read_traits(llama4).layer_types
    del llama4["text_config"]["layer_types"]  # an older config.json: transformers' rule from no_rope_layers
    assert read_traits(llama4).layer_types == ("chunked_attention",) * 3 + ("full_attention",)


def test_unknown_layer_kinds_and_softcapping_are_refused_not_ignored():
    cfg = {"model_type": "llava", "text_config": {"layer_types": ["full_attention", "hyena"],
                                                  "attn_logit_softcapping": 50.0}}
    assert read_traits(cfg).unsupported() == [
        "layer type 'hyena': unknown to mserve, not supported",
        "attention logit softcapping (50.0): not supported by the paged attention"]


def test_every_untested_builder_is_a_type_this_repository_has_no_code_for():
    from mserve.common.served_models import SERVED_MODEL_TYPES

    assert not set(BUILDERS) & set(SERVED_MODEL_TYPES)


@pytest.mark.parametrize("text_model, refusal", [
    ("qwen3_5", "linear attention layers (Gated DeltaNet): not supported outside the tested Qwen3.5 families"),
    ("llama4", "chunked attention layers (attention_chunk_size): not supported outside the tested Llama 4 family")])
def test_a_tested_model_type_over_an_untested_trait_is_refused(tiny_model_dirs, tmp_path, text_model, refusal):
    """A family's tests cover its own traits only: a LLaVA config over Qwen3.5's hybrid text model, or over
    Llama 4's chunked one, is not served on LLaVA's tests (those layers are honoured for their families alone)."""
    import re
    import shutil

    folder = tmp_path / f"llava_over_{text_model}"
    shutil.copytree(tiny_model_dirs["llava"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"] = json.loads((tiny_model_dirs[text_model] / "config.json").read_text())["text_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="^model_type 'llava': " + re.escape(refusal)):
        load_family(folder)
    for served in ("qwen3_5", "gemma3", "gemma4"):  # each honours its own trait
        assert load_family(tiny_model_dirs[served]).model_type == served
