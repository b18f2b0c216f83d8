"""Tiny checkpoints of transformers VLMs this repository has no code for, built offline.

Each is transformers' own config classes, random weights, the byte-level BPE tokenizer trained
offline (common/tiny_families/base.py) and the family's own processor saved beside it: what a user's
checkpoint folder holds. tests/workers/test_probe_families.py proves which serve and which are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mserve.common.tiny_families.base import randomize
from mserve.common.tiny_families.llava import LLAVA_CHAT_TEMPLATE, generation_config, llava_tokenizer

SIDE = 56  # the vision towers' image side: 16 patches of 14 px
VOCAB = 1000


def _clip(**extra):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=SIDE, patch_size=14, projection_dim=32, hidden_act="quick_gelu", **extra)


def _text(tok, cls: str = "LlamaConfig", **extra):
    import transformers

    return getattr(transformers, cls)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **extra)


def _save(out: Path, config, tok, processor) -> Path:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config)
    randomize(model, 0.3, seed=0)
    model.generation_config = generation_config(tok)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _clip_processor():
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})


def vipllava(out: Path) -> Path:
    """LLaVA with features from several vision layers, each normed and projected (VipLlavaMultiModalProjector)."""
    from transformers import LlavaProcessor, VipLlavaConfig

    tok = llava_tokenizer(VOCAB)
    config = VipLlavaConfig(vision_config=_clip(), text_config=_text(tok), vision_feature_layers=[-2, -1],
                            image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=16)
    processor = LlavaProcessor(image_processor=_clip_processor(), tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    return _save(out, config, tok, processor)


BUILDERS: dict[str, Callable[[Path], Path]] = {"vipllava": vipllava}


def _save_parts(out: Path, config, tok, image_processor, processor_settings: dict) -> Path:
    """For a processor that owns a video processor (its class needs torchvision to be built here): the
    parts a hub checkpoint holds, saved one by one (tokenizer, image processor, processor_config.json)."""
    import json

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config)
    randomize(model, 0.3, seed=0)
    model.generation_config = generation_config(tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps(processor_settings, indent=1))
    return out


def llava_next_video(out: Path) -> Path:
    """LLaVA-NeXT's any-res image tiles over a Mistral text model whose every layer has a sliding window
    shorter than the prompts: the window must be honoured for the tokens to match."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextVideoConfig

    tok = llava_tokenizer(VOCAB)
    pinpoints = [[SIDE, 2 * SIDE], [2 * SIDE, SIDE], [2 * SIDE, 2 * SIDE]]
    config = LlavaNextVideoConfig(
        vision_config=_clip(), text_config=_text(tok, "MistralConfig", sliding_window=24, head_dim=16),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.pad_token_id,  # no video here: a token no prompt holds
        image_grid_pinpoints=pinpoints, image_seq_length=16, vision_feature_select_strategy="default")
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE},
                                                 image_grid_pinpoints=pinpoints)
    return _save_parts(out, config, tok, image_processor, {
        "processor_class": "LlavaNextVideoProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1})


def deepseek_vl(out: Path) -> Path:
    """DeepSeek-VL: a SigLIP tower and a two-layer aligner over a Llama text model, a fixed count per image."""
    from transformers import DeepseekVLConfig, DeepseekVLImageProcessorPil, DeepseekVLProcessor, SiglipVisionConfig

    tok = llava_tokenizer(VOCAB)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=SIDE, patch_size=14)
    config = DeepseekVLConfig(vision_config=vision, text_config=_text(tok),
                              image_token_id=tok.convert_tokens_to_ids("<image>"))
    image_processor = DeepseekVLImageProcessorPil(size={"height": SIDE, "width": SIDE})
    processor = DeepseekVLProcessor(image_processor=image_processor, tokenizer=tok, num_image_tokens=16,
                                    chat_template=LLAVA_CHAT_TEMPLATE)
    return _save(out, config, tok, processor)


def video_llava(out: Path) -> Path:
    """Video-LLaVA: LLaVA with its own image tower path (LanguageBind-style), images only here."""
    from transformers import VideoLlavaConfig, VideoLlavaImageProcessor

    tok = llava_tokenizer(VOCAB)
    config = VideoLlavaConfig(vision_config=_clip(), text_config=_text(tok),
                              image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.pad_token_id,  # no video here: a token no prompt holds
                              image_seq_length=17, vision_feature_select_strategy="default")
    image_processor = VideoLlavaImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    return _save_parts(out, config, tok, image_processor, {
        "processor_class": "VideoLlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1})


def paligemma(out: Path) -> Path:
    """PaliGemma: the prompt prefix attends both ways (prefix-LM, from token_type_ids)."""
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaProcessor, SiglipImageProcessorPil, SiglipVisionConfig

    tok = llava_tokenizer(VOCAB)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    text = GemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=64,
                             image_token_index=tok.convert_tokens_to_ids("<image>"))
    processor = PaliGemmaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 28, "width": 28}),
                                   tokenizer=tok, chat_template=LLAVA_CHAT_TEMPLATE)
    return _save(out, config, tok, processor)


def _config_only(out: Path, config) -> Path:
    """A refusal comes from config.json alone, before a processor or a weight is read: the config suffices."""
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    return out


def qwen4_exp(out: Path) -> Path:
    """Qwen4-Exp: Gated DeltaNet (linear attention) layers beside indexed (sparse) attention ones. The linear
    layers are served for the tested Qwen3.5 families only (workers/linear_state.py)."""
    from transformers import Qwen4ExpConfig

    return _config_only(out, Qwen4ExpConfig(text_config={"hidden_size": 64, "num_hidden_layers": 4,
                                                         "num_attention_heads": 4, "num_key_value_heads": 2}))


def lfm2_vl(out: Path) -> Path:
    """LFM2-VL: short-convolution layers between attention ones."""
    from transformers import Lfm2VlConfig

    return _config_only(out, Lfm2VlConfig(text_config={"hidden_size": 64, "num_hidden_layers": 4,
                                                       "full_attn_idxs": [1, 3]}))


BUILDERS.update({"llava_next_video": llava_next_video, "deepseek_vl": deepseek_vl, "video_llava": video_llava,
                 "paligemma": paligemma, "qwen4_exp": qwen4_exp, "lfm2_vl": lfm2_vl})


def llava_onevision1_5(out: Path) -> Path:
    """LLaVA-OneVision-1.5: a RiceViT tower over Qwen2-VL's patch grids (smart_resize counts) and a Qwen3
    text model with 1-D positions."""
    import json

    from transformers import LlavaOnevision15Config, Qwen2VLImageProcessorPil

    from mserve.common.tiny_families.qwen import QWEN2_VL_CHAT_TEMPLATE, _qwen_token_ids, qwen_tokenizer
    from mserve.common.tiny_families.qwen import generation_config as qwen_generation

    tok = qwen_tokenizer(VOCAB)
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "out_hidden_size": 64}
    text = {"model_type": "qwen3", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": False}
    config = LlavaOnevision15Config(vision_config=vision, text_config=text, **_qwen_token_ids(tok))
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                               temporal_patch_size=1)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config)
    randomize(model, 0.3, seed=0)
    model.generation_config = qwen_generation(tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)
    video = {**image_processor.to_dict(), "video_processor_type": "Qwen2VLVideoProcessor",
             "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Exaone4_5_Processor"}))
    return out


BUILDERS["llava_onevision1_5"] = llava_onevision1_5


def lighton_ocr(out: Path) -> Path:
    """LightOnOCR: a Pixtral tower whose processor lays each image out in rows ended by [IMG_BREAK] and
    [IMG_END], which the generic path (one run of image tokens per image) does not: the probe must refuse it."""
    from transformers import LightOnOcrConfig, LightOnOcrProcessor, PixtralImageProcessorPil, PreTrainedTokenizerFast
    from transformers import PixtralVisionConfig

    from mserve.common.tiny_families.base import train_bpe
    from mserve.common.tiny_families.mistral3 import MISTRAL3_CHAT_TEMPLATE, MISTRAL3_SPECIALS

    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(VOCAB, MISTRAL3_SPECIALS, []), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", chat_template=MISTRAL3_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, image_size=112, patch_size=14, hidden_act="silu")
    text = {"model_type": "qwen3", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": False}
    config = LightOnOcrConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("[IMG]"),
                              spatial_merge_size=2, tie_word_embeddings=False)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size={"height": 14, "width": 14})
    processor = LightOnOcrProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14, spatial_merge_size=2,
                                    chat_template=MISTRAL3_CHAT_TEMPLATE)
    return _save(out, config, tok, processor)


BUILDERS["lighton_ocr"] = lighton_ocr
