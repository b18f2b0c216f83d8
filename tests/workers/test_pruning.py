"""Opt-in visual-token pruning (FasterVLM, common/pruning.py): counts, order, placeholders, refusals,
and the pruned engine against an independent Hugging Face computation on the same pruned inputs."""

from __future__ import annotations

import io
import json
import logging
from functools import lru_cache

import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from mserve.common import pruning
from mserve.common.prompt import PromptBuilder
from mserve.common.protocol import MsgType
from mserve.common.protocol.to_coordinator import Heartbeat, WorkerInfo
from mserve.common.pruning import PruningError, kept_tokens, parse_ratio
from mserve.coordinator.admission import Limits, admit
from mserve.coordinator.requests import RequestMachine
from mserve.coordinator.settings import CoordinatorSettings, MachineSettings
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.model_loading import load_vlm
from mserve.workers.sequence import SamplingParams
from mserve.workers.settings import WorkerSettings
from tests.helpers import hf_generate, make_image

MAX_NEW = 8
PROMPT = "Describe the picture."


@pytest.fixture(scope="module")
def llava(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llava"])


@pytest.fixture(scope="module")
def model(llava):
    """One loaded copy of the weights, shared by every engine below (each with its own ratio)."""
    return load_vlm(llava, dtype="float32")


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [make_image(200, 150, seed=7), make_image(160, 240, seed=8)]


def engine(llava: str, model, ratio: float | None) -> Engine:
    return Engine(EngineConfig(llava, dtype="float32", num_blocks=128, visual_token_pruning=ratio), model=model)


def run(llava: str, model, ratio: float | None, images: list[bytes]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of one request through an engine pruning at `ratio`."""
    pp = PromptBuilder(llava, visual_token_pruning=ratio).prepare_text(PROMPT, images)
    e = engine(llava, model, ratio)
    e.add_request("r", pp.prompt_ids, images=images, sampling=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    out = e.run_until_done()["r"]
    e.pool.check_integrity()
    assert e.pool.num_used_blocks == 0
    return pp.prompt_ids, out


# -- the reference: transformers' own modules, eager attention weights, HF generate --------------------------
@lru_cache(maxsize=1)
def eager_model(model_dir: str):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager").eval()
    return ref, AutoImageProcessor.from_pretrained(model_dir, backend="pil")


@torch.inference_mode()
def reference_features(model_dir: str, images: list[bytes], ratio: float) -> tuple[list[torch.Tensor], ...]:
    """FasterVLM written out plainly: the vision tower's [CLS] attention weights (output_attentions) of
    the feature layer, mean over heads, top-k patches kept in order; returns (kept rows, kept indices)."""
    ref, proc = eager_model(model_dir)
    cfg = ref.config
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    pixels = proc(images=pil, return_tensors="pt")["pixel_values"]
    out = ref.model.vision_tower(pixels, output_attentions=True, output_hidden_states=True)
    scores = out.attentions[cfg.vision_feature_layer][:, :, 0, 1:].mean(dim=1)  # CLS -> patches, [B, N]
    features = ref.model.multi_modal_projector(out.hidden_states[cfg.vision_feature_layer][:, 1:])
    keep = kept_tokens(features.shape[1], ratio)
    idx = [torch.topk(s, keep).indices.sort().values for s in scores]
    return [f[i] for f, i in zip(features, idx)], idx


@torch.inference_mode()
def reference_generate(model_dir: str, prompt_ids: list[int], images: list[bytes], ratio: float) -> list[int]:
    """HF generate() fed the prompt's embeddings with the reference's pruned image features scattered in."""
    ref, _ = eager_model(model_dir)
    ids = torch.tensor([prompt_ids])
    embeds = ref.get_input_embeddings()(ids)
    mask = ids == ref.config.image_token_id
    embeds[mask] = torch.cat(reference_features(model_dir, images, ratio)[0]).to(embeds.dtype)
    out = ref.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].tolist()[-MAX_NEW:]


# -- tests ---------------------------------------------------------------------------------------------------
def test_count_rule_and_values():
    assert [kept_tokens(576, r) for r in (1.0, 0.75, 0.5, 0.25)] == [576, 432, 288, 144]
    assert kept_tokens(30, 0.1) == 3  # exact decimal arithmetic: not ceil(3.0000000000000004)
    assert kept_tokens(64, 0.3) == 20 and kept_tokens(5, 0.01) == 1 and kept_tokens(64, None) == 64
    assert parse_ratio("off") is None and parse_ratio(None) is None and parse_ratio("0.5") == 0.5
    for bad in (0, -0.5, 1.5, "nan", "inf", "half", True):
        with pytest.raises(PruningError, match="--visual-token-pruning"):
            parse_ratio(bad)


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_keeps_top_cls_tokens_in_original_order(llava, model, images, ratio):
    full = engine(llava, model, None).runner.encode_images([Image.open(io.BytesIO(b)).convert("RGB") for b in images])
    pruned = engine(llava, model, ratio).runner.encode_images(
        [Image.open(io.BytesIO(b)).convert("RGB") for b in images])
    _, ref_idx = reference_features(llava, images, ratio)
    for f, p, idx in zip(full, pruned, ref_idx):
        n = f.embeds.shape[0]
        assert p.embeds.shape == (kept_tokens(n, ratio), f.embeds.shape[1]) and p.embeds.shape[0] < n
        assert bool((idx[1:] > idx[:-1]).all())  # original order
        torch.testing.assert_close(p.embeds, f.embeds[idx])  # exactly the reference's rows, nothing else


def test_placeholders_match_admission_and_engine(llava, model, images):
    builder = PromptBuilder(llava, visual_token_pruning=0.5)
    per_image = kept_tokens(PromptBuilder(llava).family.visual_token_count((200, 150)), 0.5)
    admitted = admit(builder, Limits(), {"request_id": "a", "messages": [{"role": "user", "content": [
        {"type": "image", "image": images[0]}, {"type": "image", "image": images[1]},
        {"type": "text", "text": PROMPT}]}]})
    assert [im.num_tokens for im in admitted.images] == [per_image, per_image]
    assert admitted.prompt_ids.count(builder.family.image_token_id) == 2 * per_image
    prompt_ids, out = run(llava, model, 0.5, images)  # the engine takes the pruned prompt end to end
    assert prompt_ids == admitted.prompt_ids and len(out) == MAX_NEW


def test_ratio_one_is_hf_exact(llava, model, images):
    prompt_ids, out = run(llava, model, 1.0, images)
    assert prompt_ids == PromptBuilder(llava).prepare_text(PROMPT, images).prompt_ids
    assert out == hf_generate(llava, prompt_ids, images, MAX_NEW, ignore_eos=True) == run(llava, model, None, images)[1]


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_pruned_engine_matches_hf_on_pruned_embeddings(llava, model, images, ratio):
    prompt_ids, out = run(llava, model, ratio, images)
    assert out == reference_generate(llava, prompt_ids, images, ratio)


def test_refusals_name_the_setting(tiny_model_dirs):
    qwen = str(tiny_model_dirs["qwen2_vl"])
    with pytest.raises(PruningError, match=r"--visual-token-pruning.*qwen2_vl"):
        PromptBuilder(qwen, visual_token_pruning=0.5)
    with pytest.raises(PruningError, match="--visual-token-pruning"):  # before any weight is loaded
        Engine(EngineConfig(qwen, dtype="float32", visual_token_pruning=0.5))
    PromptBuilder(qwen, visual_token_pruning="off")  # off is fine for every family
    for cls, extra in ((WorkerSettings, {"role": "encode"}), (CoordinatorSettings, {})):
        with pytest.raises(ValidationError, match="visual_token_pruning"):
            cls(model="m", visual_token_pruning=1.5, **extra)
        assert cls(model="m", visual_token_pruning="off", **extra).visual_token_pruning is None


def test_coordinator_refuses_a_mismatched_encoder(caplog):
    machine = RequestMachine(MachineSettings(visual_token_pruning=0.5), raise_errors=True)

    def ready(wid: str, role: str, ratio: float | None, kind: MsgType = MsgType.READY) -> None:
        info = WorkerInfo(worker_id=wid, role=role, data_address=f"tcp://{wid}", host_id="h",
                          visual_token_pruning=ratio)
        machine.on_worker(wid, kind, (info if kind == MsgType.READY else Heartbeat.of(info)).to_body(), now=0.0)

    with caplog.at_level(logging.ERROR, logger="mserve.coordinator"):
        ready("enc-off", "encode", None)
        ready("enc-off", "encode", None, MsgType.HEARTBEAT)  # its heartbeats re-register: refused, logged once
        ready("uni-25", "unified", 0.25)
        ready("enc-50", "encode", 0.5)
        ready("pre-off", "prefill", None)  # prefill and decode never see pixels
    assert sorted(machine.alive_workers()) == ["enc-50", "pre-off"]
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and all("--visual-token-pruning" in m for m in refusals)
    assert "runs --visual-token-pruning off" in refusals[0] and "0.5" in refusals[0]
    ready("enc-50", "encode", None)  # restarted under the same id with another setting: its old self is gone
    assert machine.alive_workers() == ["pre-off"]
    assert pruning.mismatch("w", "encode", 1.0, None) is None  # keeping every token is the same as off


def test_generate_cli_prunes(llava, images, tmp_path, capsys):
    from mserve.cli import main

    path = tmp_path / "a.png"
    path.write_bytes(images[0])
    assert main(["generate", "--model", llava, "--prompt", PROMPT, "--image", str(path), "--max-tokens", "4",
                 "--visual-token-pruning", "0.25", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)["prompt_token_ids"]
    family = PromptBuilder(llava).family
    assert ids.count(family.image_token_id) == kept_tokens(family.visual_token_count((1, 1)), 0.25)
