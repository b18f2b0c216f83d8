"""Tests for mserve.common.tiny_model: the random-weight VLM folders load offline and generate."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mserve.common.tiny_families import AUDIO_ARCHS, TEXT_ONLY_ARCHS
from mserve.common.tiny_model import TINY_MODEL_ARCHS, make_tiny_model

IMAGE_TOKEN = {"llava": "<image>", "qwen2_vl": "<|image_pad|>", "llava_next": "<image>", "qwen2_5_vl": "<|image_pad|>",
               "mistral3": "[IMG]", "gemma3": "<image_soft_token>", "gemma4": "<|image|>", "internvl": "<IMG_CONTEXT>", "smolvlm": "<image>",
               "idefics3": "<image>", "qwen3_vl": "<|image_pad|>", "qwen3_vl_moe": "<|image_pad|>",
               "glm46v": "<|image|>", "glm4v": "<|image|>", "glm4v_moe": "<|image|>",
               "qwen3_5": "<|image_pad|>", "qwen3_5_moe": "<|image_pad|>"}
ARCHITECTURE = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
                "llava_next": "LlavaNextForConditionalGeneration",
                "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "mistral3": "Mistral3ForConditionalGeneration",
                "gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration",
                "internvl": "InternVLForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration",
                "idefics3": "Idefics3ForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                "glm46v": "Glm46VForConditionalGeneration", "glm4v": "Glm4vForConditionalGeneration",
                "glm4v_moe": "Glm4vMoeForConditionalGeneration",
                "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
PROCESSOR = {"llava": "LlavaProcessor", "qwen2_vl": "Qwen2VLProcessor", "llava_next": "LlavaNextProcessor",
             "qwen2_5_vl": "Qwen2_5_VLProcessor", "mistral3": "PixtralProcessor",
             "gemma3": "Gemma3Processor", "gemma4": "Gemma4Processor", "internvl": "InternVLProcessor",
             "smolvlm": "SmolVLMProcessor", "idefics3": "Idefics3Processor", "qwen3_vl": "Qwen3VLProcessor",
             "qwen3_vl_moe": "Qwen3VLProcessor", "glm46v": "Glm46VProcessor", "glm4v": "Glm4vProcessor",
             "glm4v_moe": "Glm4vProcessor", "qwen3_5": "Qwen3VLProcessor", "qwen3_5_moe": "Qwen3VLProcessor"}
# Processors transformers' AutoProcessor hands out only with torchvision installed (a video processor, or
# PixtralProcessor's module importing a helper from the torchvision image processor).
NEEDS_TORCHVISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "mistral3", "internvl", "smolvlm",
                     "glm46v", "glm4v", "glm4v_moe", "gemma4")
# Families whose test inputs come from mserve's processor build (common/processor.py).
BUILT_FROM_PARTS = ("internvl", "smolvlm", "idefics3", "glm46v", "glm4v", "glm4v_moe", "gemma4")
TIED = ("gemma3", "gemma4")  # tie_word_embeddings, as the published checkpoints
GLM = ("glm46v", "glm4v", "glm4v_moe")
CHATML_EOS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl")  # eos [<|im_end|>, <|endoftext|>]
QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # one tower, processor and template (Qwen3.5 adds <think>)
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


# The image families; the audio ones (no image processor) are tests/common/test_tiny_audio_model.py's, the
# text-only ones (an image processor that needs torchvision) tests/workers/test_engine_llama4.py's.
@pytest.fixture(scope="module", params=[a for a in TINY_MODEL_ARCHS if a not in AUDIO_ARCHS + TEXT_ONLY_ARCHS])
def tiny(request, tmp_path_factory):
    """(arch, path) of a tiny model, built once per arch for the whole module."""
    arch = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, "tiny", seed=0)
    return arch, path


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def loaded(tiny):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    arch, path = tiny
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return arch, path, model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def _image(seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    return Image.fromarray(pixels)  # 200 wide, 150 high


def _prompt(tokenizer, question: str = "What is shown in this image?") -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _model_inputs(arch, path, tokenizer, image_processor, image) -> dict:
    """Tokenized prompt with the image token expanded, plus pixel inputs."""
    if arch == "mistral3":  # the template writes BOS: tokenized without special tokens, as apply_chat_template does
        from mserve.common.processor import build_processor

        processor = build_processor(path, arch)
        return dict(processor(images=image, text=_prompt(tokenizer), return_tensors="pt", add_special_tokens=False))
    if arch in BUILT_FROM_PARTS:
        from mserve.common.processor import build_processor

        processor = build_processor(path, arch)
        return dict(processor(images=[image], text=_prompt(tokenizer), return_tensors="pt"))
    if not arch.startswith("qwen"):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        return dict(processor(images=image, text=_prompt(tokenizer), return_tensors="pt"))
    # Qwen2VLProcessor needs torchvision (video processor): expand <|image_pad|> by hand.
    pixels = image_processor(images=[image], return_tensors="pt")
    n_tokens = int(pixels["image_grid_thw"][0].prod()) // image_processor.merge_size**2
    text = _prompt(tokenizer).replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    inputs = {**tokenizer(text, return_tensors="pt"), **pixels}
    if arch in QWEN3_VL:  # its processor marks the image tokens for the rope index; generate() needs them
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return inputs


def test_folder_has_checkpoint_files(tiny):
    arch, path = tiny
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is (arch in TIED)
    assert config["architectures"] == [ARCHITECTURE[arch]]


def test_config_ids_match_tokenizer(loaded):
    arch, _, model, tokenizer, _ = loaded
    config = model.config
    assert config.text_config.vocab_size == len(tokenizer) == 1000
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[arch])
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied is (arch in TIED)
    if arch.startswith("qwen"):
        for attr, token in [("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                            ("vision_end_token_id", "<|vision_end|>")]:
            assert getattr(config, attr) == tokenizer.convert_tokens_to_ids(token)
    if arch in CHATML_EOS:
        assert model.generation_config.eos_token_id[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    elif arch == "gemma3":
        assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(["<eos>", "<end_of_turn>"])
        for attr, token in [("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>")]:
            assert getattr(config, attr) == tokenizer.convert_tokens_to_ids(token)
    elif arch == "gemma4":
        assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(["<eos>", "<turn|>"])
        for attr, token in [("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>")]:
            assert getattr(config, attr) == tokenizer.convert_tokens_to_ids(token)
    elif arch in ("smolvlm", "idefics3"):
        assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    elif arch in GLM:
        assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(
            ["<|endoftext|>", "<|user|>", "<|observation|>"])
        for attr, token in [("video_token_id", "<|video|>"), ("image_start_token_id", "<|begin_of_image|>"),
                            ("image_end_token_id", "<|end_of_image|>"), ("video_start_token_id", "<|begin_of_video|>")]:
            assert getattr(config, attr) == tokenizer.convert_tokens_to_ids(token)
    else:
        assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")


def test_chat_template_renders_image_token(loaded):
    arch, _, _, tokenizer, _ = loaded
    prompt = _prompt(tokenizer)
    ids = tokenizer(prompt)["input_ids"]
    if arch == "gemma3":  # the template places <start_of_image>; the processor expands it to the soft tokens
        assert prompt == ("<bos><start_of_turn>user\n<start_of_image>What is shown in this image?<end_of_turn>\n"
                          "<start_of_turn>model\n")
        assert tokenizer.convert_tokens_to_ids("<start_of_image>") in ids
        return
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[arch]) in ids
    if arch == "mistral3":
        assert prompt == "<s>[INST][IMG]What is shown in this image?[/INST]"
    elif arch == "gemma4":  # the processor expands the image token to <|image> + soft tokens + <image|>
        assert prompt == "<bos><|turn>user\n<|image|>What is shown in this image?<turn|>\n<|turn>model\n"
    elif arch == "internvl":
        assert prompt == "<|im_start|>user\n<IMG_CONTEXT>\nWhat is shown in this image?<|im_end|>\n<|im_start|>assistant\n"
    elif arch == "idefics3":
        assert prompt == "<|begin_of_text|>User:<image>What is shown in this image?<end_of_utterance>\nAssistant:"
    elif arch == "smolvlm":
        assert prompt == "<|im_start|>User:<image>What is shown in this image?<end_of_utterance>\nAssistant:"
    elif arch in QWEN3_VL:  # no default system turn in Qwen3-VL's template
        assert prompt.startswith("<|im_start|>user\n<|vision_start|>")
        assert "<|vision_start|><|image_pad|><|vision_end|>What is shown" in prompt
        # Qwen3.5 opens its thinking block on the generation prompt, <think> one special token
        assert prompt.endswith("<|im_start|>assistant\n" + ("<think>\n" if arch.startswith("qwen3_5") else ""))
        assert not arch.startswith("qwen3_5") or tokenizer.convert_tokens_to_ids("<think>") in ids
    elif arch in GLM:  # [gMASK]<sop> is GLM's BOS, written by the template
        assert prompt == ("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>What is shown in this "
                          "image?<|assistant|>\n")
    elif not arch.startswith("qwen"):
        assert prompt == "USER: <image>\nWhat is shown in this image? ASSISTANT:"
        assert ids[0] == tokenizer.bos_token_id  # added by the tokenizer, as for llava-hf
    elif arch in QWEN3_VL:  # no default system turn in Qwen3-VL's template
        assert prompt.startswith("<|im_start|>user\n<|vision_start|>")
        assert "<|vision_start|><|image_pad|><|vision_end|>What is shown" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    else:
        assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        assert "<|vision_start|><|image_pad|><|vision_end|>What is shown" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")


def test_image_processing_shapes(loaded):
    arch, path, _, tokenizer, image_processor = loaded
    inputs = _model_inputs(arch, path, tokenizer, image_processor, _image())
    n_image_tokens = int((inputs["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[arch])).sum())
    if arch == "llava":
        assert tuple(inputs["pixel_values"].shape) == (1, 3, 112, 112)
        assert n_image_tokens == 64  # (112 / 14)^2
    elif arch == "llava_next":
        # 200x150 -> the 112x112 canvas (2x2 tiles of 56) plus the base view: 5 tiles
        assert tuple(inputs["pixel_values"].shape) == (1, 5, 3, 56, 56)
        assert inputs["image_sizes"].tolist() == [[150, 200]]
        # base view 4x4 = 16; the 8x8 tile grid unpadded to 150/200 of its height: 6 rows of 8, a newline each
        assert n_image_tokens == 16 + 6 * 8 + 6
    elif arch == "mistral3":
        # 200x150 -> longest edge 168: 168x126, padded up to whole 28-px merged patches: 168x140 = 6x5 tokens
        assert tuple(inputs["pixel_values"].shape) == (1, 3, 140, 168)
        assert inputs["image_sizes"].tolist() == [[140, 168]]
        assert n_image_tokens == 30
        assert int((inputs["input_ids"] == tokenizer.convert_tokens_to_ids("[IMG_BREAK]")).sum()) == 4
    elif arch == "gemma3":  # resized to 112x112 = 8x8 patches, average-pooled to 4x4 = mm_tokens_per_image
        assert tuple(inputs["pixel_values"].shape) == (1, 3, 112, 112)
        assert n_image_tokens == 16
        assert inputs["token_type_ids"].sum() == 16
    elif arch == "gemma4":
        # 200x150 kept in shape within 70 soft tokens of 2x2 patches of 4 px: 72x56 = 18x14 patches -> 63 tokens,
        # the patches padded to 70 * 4
        assert tuple(inputs["pixel_values"].shape) == (1, 280, 3 * 4 * 4)
        assert n_image_tokens == 63
        assert inputs["mm_token_type_ids"].sum() == 63
    elif arch == "internvl":
        # 200x150 -> the best canvas of at most 6 tiles of 56 px is 3x2, plus the thumbnail: 7 tiles of 4 tokens
        assert tuple(inputs["pixel_values"].shape) == (7, 3, 56, 56)
        assert n_image_tokens == 7 * 4
    elif arch in ("smolvlm", "idefics3"):
        # 200x150 -> rescaled to a 168 px longest edge (168x126) -> 3x3 tiles of 56 px plus the global view
        assert tuple(inputs["pixel_values"].shape) == (1, 10, 3, 56, 56)
        assert n_image_tokens == 10 * 4
    elif arch in QWEN3_VL:
        # 150x200 -> smart_resize (16 px patches, 2x2 merge: factor 32) -> 160x192 = 10x12 patches -> 30 tokens
        assert inputs["image_grid_thw"].tolist() == [[1, 10, 12]]
        assert tuple(inputs["pixel_values"].shape) == (120, 3 * 2 * 16 * 16)
        assert n_image_tokens == 30
    else:  # Qwen2-VL, Qwen2.5-VL, GLM-4V (GLM's smart_resize: 2 x 140 x 196 is within its budget)
        # 150x200 -> smart_resize -> 140x196 = 10x14 patches, merged 2x2 -> 35 tokens
        assert inputs["image_grid_thw"].tolist() == [[1, 10, 14]]
        assert tuple(inputs["pixel_values"].shape) == (140, 3 * 2 * 14 * 14)
        assert n_image_tokens == 35


def test_greedy_generation_is_not_degenerate(loaded):
    arch, path, model, tokenizer, image_processor = loaded
    inputs = _model_inputs(arch, path, tokenizer, image_processor, _image())
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) == 12
    assert len(set(new)) >= 3, new


def test_auto_processor(tiny):
    from transformers import AutoProcessor

    arch, path = tiny
    if arch in NEEDS_TORCHVISION and not HAS_TORCHVISION:
        # Documented limitation: Qwen2VLProcessor requires Qwen2VLVideoProcessor -> torchvision.
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(path)
        return
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == PROCESSOR[arch]
    assert processor.chat_template  # the processor carries the chat template too


def test_same_seed_same_bytes(tiny, tmp_path):
    arch, path = tiny
    again = make_tiny_model(tmp_path / "again", arch, "tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", arch, "tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (path / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch, size", [("gpt2", "tiny"), ("llava", "huge")])
def test_unknown_arch_or_size(tmp_path, arch, size):
    with pytest.raises(ValueError, match="unknown (arch|size)"):
        make_tiny_model(tmp_path, arch, size)


def test_cli_offers_every_family():
    """`mserve make-tiny-model --arch` lists exactly the registered families (the CLI does not import torch)."""
    import argparse

    from mserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    arch = next(a for a in sub.choices["make-tiny-model"]._actions if "--arch" in a.option_strings)
    assert set(arch.choices) == set(TINY_MODEL_ARCHS)  # the served families are the ones it builds
