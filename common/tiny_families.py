"""The real architectures and processors of each tiny-model family: configs and processor files.

`common/tiny_model.py` trains the tokenizer, draws the weights and saves the folder; this module
says what each family is made of (its transformers config classes, its PIL image processor and
processor class, saved the way current transformers saves them).
"""

from __future__ import annotations

import json
from pathlib import Path

from mserve.common.tiny_model import LLAVA_CHAT_TEMPLATE, PATCH_SIZE, QWEN2_VL_CHAT_TEMPLATE


def llava_config(dims: dict, tok, std: float):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_hidden_layers=dims["v_layers"], num_attention_heads=dims["v_heads"],
        image_size=dims["image_size"], patch_size=PATCH_SIZE, projection_dim=dims["v_hidden"],
        hidden_act="quick_gelu", initializer_range=std,
    )
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, initializer_range=std,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(dims["image_size"] // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu", vision_feature_select_strategy="default",
        vision_feature_layer=-2, tie_word_embeddings=False,
    )


def _grid_pinpoints(side: int) -> list[list[int]]:
    """LLaVA-NeXT's any-res canvases (height, width), in tiles of the vision tower's side: 1x2, 2x1, 2x2,
    1x3, 3x1 as llava-hf's v1.6 checkpoints (whose side is 336)."""
    return [[side * h, side * w] for h, w in ((1, 2), (2, 1), (2, 2), (1, 3), (3, 1))]


def llava_next_config(dims: dict, tok, std: float):
    from transformers import LlavaNextConfig

    base = llava_config(dims, tok, std)
    return LlavaNextConfig(
        vision_config=base.vision_config, text_config=base.text_config,
        image_token_index=base.image_token_index, image_grid_pinpoints=_grid_pinpoints(dims["image_size"]),
        image_seq_length=base.image_seq_length, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2, tie_word_embeddings=False,
    )


def qwen2_vl_config(dims: dict, tok, std: float):
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=dims["v_layers"], embed_dim=dims["v_hidden"], hidden_size=dims["hidden"],
        num_heads=dims["v_heads"], mlp_ratio=dims["v_mlp_ratio"], patch_size=PATCH_SIZE,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu",
        initializer_range=std,
    )
    return Qwen2VLConfig(text_config=_qwen_text(dims, tok, std), vision_config=vision, tie_word_embeddings=False,
                         **_qwen_token_ids(tok))


def qwen2_5_vl_config(dims: dict, tok, std: float):
    from transformers import Qwen2_5_VLConfig

    # Qwen2.5-VL's tower: SwiGLU MLP, window attention (112 px windows = 4x4 merged patches here) with
    # the last block attending over the whole image, as the real checkpoints' fullatt_block_indexes do.
    vision = dict(
        depth=dims["v_layers"], hidden_size=dims["v_hidden"], intermediate_size=dims["v_inter"],
        num_heads=dims["v_heads"], out_hidden_size=dims["hidden"], patch_size=PATCH_SIZE,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="silu", window_size=112,
        fullatt_block_indexes=[dims["v_layers"] - 1], tokens_per_second=2, initializer_range=std,
    )
    return Qwen2_5_VLConfig(text_config=_qwen_text(dims, tok, std), vision_config=vision,
                            tie_word_embeddings=False, **_qwen_token_ids(tok))


def _qwen_token_ids(tok) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _qwen_text(dims: dict, tok, std: float) -> dict:
    head_dim = dims["hidden"] // dims["heads"]
    # M-RoPE splits the head_dim/2 rotary frequencies over (temporal, height, width);
    # keep Qwen's 2:3:3 proportion (the real 128-dim heads use [16, 24, 24]).
    half = head_dim // 2
    t_dim = half // 4
    h_dim = (half - t_dim) // 2
    mrope_section = [t_dim, h_dim, half - t_dim - h_dim]
    return dict(
        vocab_size=len(tok), hidden_size=dims["hidden"], intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        max_window_layers=dims["layers"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, initializer_range=std,
    )


def save_llava_processor(out: Path, dims: dict, tok, layout: str) -> None:
    # The PIL backend: CLIPImageProcessor proper is the torchvision one in transformers 5.
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    side = dims["image_size"]
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)  # processor_config.json (nested), tokenizer, chat template
    if layout != "processor":
        image_processor.save_pretrained(out)  # legacy preprocessor_config.json, as on the hub
    if layout == "preprocessor":  # llava-hf's processor_config.json: the processor's own keys only
        _drop_nested_image_processor(out)


def save_llava_next_processor(out: Path, dims: dict, tok, layout: str) -> None:
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    side = dims["image_size"]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        image_grid_pinpoints=_grid_pinpoints(side),
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    if layout != "processor":
        image_processor.save_pretrained(out)
    if layout == "preprocessor":
        _drop_nested_image_processor(out)


class _VideoProcessorConfig(dict):
    """Stands in for Qwen2VLVideoProcessor, which needs torchvision: ProcessorMixin.save_pretrained
    writes a sub-processor that is a plain dict as it is (and skips custom-code saving: no auto class)."""

    _auto_class = None


def _qwen2_vl_processor(image_processor, tok, video_config: dict, processor_class: str = "Qwen2VLProcessor"):
    """A real Qwen2VLProcessor (or Qwen2_5_VLProcessor) whose video processor is the `_VideoProcessorConfig` stand-in.

    ProcessorMixin.__init__ type-checks every sub-processor, and without torchvision the video
    processor check cannot even run, so that one check is skipped for this one instance."""
    import transformers

    cls = getattr(transformers, processor_class)
    processor = cls.__new__(cls)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = (
        lambda name, arg: dict if name == "video_processor" else check(name, arg))
    processor.__init__(image_processor=image_processor, tokenizer=tok, chat_template=QWEN2_VL_CHAT_TEMPLATE,
                       video_processor=_VideoProcessorConfig(video_config))
    del processor.check_argument_for_proper_class
    return processor


def save_qwen2_vl_processor(out: Path, dims: dict, tok, layout: str, processor_class: str = "Qwen2VLProcessor") -> None:
    """Write the processor files of a Qwen2-VL (or Qwen2.5-VL: the same image and video processors) folder.

    processor_config.json (image and video processors nested), the tokenizer and the chat template
    come from ``Qwen2VLProcessor.save_pretrained``; the video processor's settings are written by
    hand (its class needs torchvision). The legacy preprocessor_config.json /
    video_preprocessor_config.json are those of the hub checkpoints.
    """
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=dims["max_pixels"], patch_size=PATCH_SIZE,
        merge_size=2, temporal_patch_size=2,
    )
    image_config = {**image_processor.to_dict(), "processor_class": processor_class}
    video_config = {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": processor_class,
        "size": {"shortest_edge": 56 * 56, "longest_edge": dims["max_pixels"]},
        "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": image_config["image_mean"], "image_std": image_config["image_std"],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "resample": 3, "rescale_factor": 1 / 255,
    }
    _qwen2_vl_processor(image_processor, tok, video_config, processor_class).save_pretrained(out)
    if layout != "processor":
        for name, config in [("preprocessor_config.json", image_config),
                             ("video_preprocessor_config.json", video_config)]:
            (out / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if layout == "preprocessor":  # Qwen/Qwen2-VL-*-Instruct on the hub have no processor_config.json
        (out / "processor_config.json").unlink()


def _drop_nested_image_processor(out: Path) -> None:
    path = out / "processor_config.json"
    config = json.loads(path.read_text())
    del config["image_processor"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
