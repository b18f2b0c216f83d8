"""Every layout transformers reads the image processor settings from is served, and served exactly.

transformers (AutoImageProcessor.from_pretrained -> ImageProcessingMixin.get_image_processor_dict, which
AutoProcessor / ProcessorMixin.from_pretrained also go through) takes the "image_processor" entry of
processor_config.json first, else preprocessor_config.json. `load_family` (admission's placeholder
counts) and the worker's image processor are one processor built from those settings, for every layout.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path
import shutil

import pytest
from PIL import Image

from mserve.common.model import CheckpointError, load_family
from mserve.common.prompt import PromptBuilder
from mserve.common.tiny_model import LAYOUTS, make_tiny_model
from tests.helpers import make_image
from tests.workers.test_engine_oracle import check_against_hf, greedy, new_engine, prepared

ARCHS = ["llava", "qwen2_vl", "llava_next", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
SIZES = [(64, 48), (300, 200), (500, 120), (17, 301)]  # (width, height)
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
IMAGE_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


@pytest.fixture(scope="module", params=[(a, lay) for a in ARCHS for lay in LAYOUTS],
                ids=[f"{a}-{lay}" for a in ARCHS for lay in LAYOUTS])
def checkpoint(request, tiny_model_dirs, tmp_path_factory) -> tuple[str, str, Path]:
    """(arch, layout, folder): the same tiny model (seed 0) written in each layout."""
    arch, layout = request.param
    if layout == "both":  # the session's checkpoints are written in the default layout
        return arch, layout, tiny_model_dirs[arch]
    return arch, layout, make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{layout}"), arch, "tiny", seed=0,
                                         layout=layout)


def hf_visual_tokens(arch: str, model_dir: Path, width: int, height: int) -> int:
    """How many image tokens transformers' own processor gives one image of that size."""
    from transformers import AutoImageProcessor, AutoProcessor

    image = Image.open(io.BytesIO(make_image(width, height))).convert("RGB")
    if not arch.startswith("qwen") or HAS_TORCHVISION:  # LLaVA and LLaVA-NeXT processors own no video processor
        processor = AutoProcessor.from_pretrained(model_dir)
        ids = processor(images=[image], text=processor.image_token, return_tensors="pt")["input_ids"]
        return int((ids == processor.image_token_id).sum())
    # Qwen2VLProcessor needs torchvision (its video processor); its image count is, in replace_image_token,
    # image_grid_thw.prod() // merge_size**2 from the image processor AutoProcessor would load.
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // processor.merge_size ** 2


def test_layout_files(checkpoint):
    arch, layout, path = checkpoint
    present = {name for name in IMAGE_PROCESSOR_FILES if (path / name).is_file()}
    nested = "processor_config.json" in present and "image_processor" in json.loads(
        (path / "processor_config.json").read_text())
    if layout == "processor":
        assert present == {"processor_config.json"} and nested
    elif layout == "preprocessor":
        assert "preprocessor_config.json" in present and not nested
        assert ("processor_config.json" in present) == (not arch.startswith("qwen"))
    else:
        assert {"processor_config.json", "preprocessor_config.json"} <= present and nested
    source = load_family(path).processor_source
    assert source.startswith(str(path / ("preprocessor_config.json" if layout == "preprocessor" else
                                         "processor_config.json")))


def test_visual_token_counts_match_hf_processor(checkpoint):
    arch, _, path = checkpoint
    family = load_family(path)
    ours = [family.visual_token_count(size) for size in SIZES]
    assert ours == [hf_visual_tokens(arch, path, *size) for size in SIZES]
    if arch != "llava":
        assert len(set(ours)) == len(SIZES)  # the sizes really exercise smart_resize / the any-res canvases


def test_engine_matches_hf_generate(checkpoint):
    """Prompt building, the worker's image processor, encode, prefill and decode: HF's greedy tokens."""
    _, _, path = checkpoint
    model_dir = str(path)
    pp = prepared(PromptBuilder(model_dir), 1, 2, size=(300, 200))
    engine = new_engine(model_dir)
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=greedy())
    check_against_hf(model_dir, {"r": pp}, engine.run_until_done())


# ---- precedence and errors on hand-made folders (no weights) ---------------------------------------------

CLIP = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 112},
        "crop_size": {"height": 112, "width": 112}}
CLIP_224 = {**CLIP, "size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}
QWEN = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
        "size": {"shortest_edge": 3136, "longest_edge": 50176}}
QWEN_HUB = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
            "min_pixels": 3136, "max_pixels": 200704}  # Qwen/Qwen2-VL-*-Instruct style keys


def folder(root: Path, model_type: str, processor: dict | None = None, preprocessor: dict | None = None,
           tokenizer_from: Path | None = None) -> Path:
    """A checkpoint folder with config.json, the given processor_config.json / preprocessor_config.json and
    (tokenizer_from) the tokenizer files of a tiny model: the processor is built with its tokenizer."""
    config = {"model_type": model_type, "image_token_id": 3, "vision_config": {"patch_size": 14}}
    root.mkdir(parents=True, exist_ok=True)
    for name, data in (("config.json", config), ("processor_config.json", processor),
                       ("preprocessor_config.json", preprocessor)):
        if data is not None:
            (root / name).write_text(json.dumps(data))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if tokenizer_from is not None:
            shutil.copy(tokenizer_from / name, root / name)
    return root


# LlavaProcessor's own settings (llava-hf's flat processor_config.json keys); without patch_size it cannot count.
LLAVA_KEYS = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}


@pytest.mark.parametrize("processor, preprocessor, expected", [
    ({"image_processor": CLIP, **LLAVA_KEYS}, CLIP_224, 112),  # the nested entry wins
    ({"image_processor": CLIP, **LLAVA_KEYS}, None, 112),
    (LLAVA_KEYS, CLIP_224, 224),  # no entry: legacy file
    (LLAVA_KEYS, {**CLIP, "crop_size": 140}, 140),  # an int crop is a square
], ids=["nested-over-legacy", "nested-only", "flat-processor-config", "int-crop"])
def test_llava_precedence_is_transformers(tmp_path, tiny_model_dirs, processor, preprocessor, expected):
    from transformers import AutoProcessor

    path = folder(tmp_path, "llava", processor, preprocessor, tiny_model_dirs["llava"])
    family = load_family(path)
    assert family.visual_token_count((640, 480)) == (expected // 14) ** 2
    theirs = AutoProcessor.from_pretrained(path)  # LlavaProcessor loads without torchvision
    assert family.visual_token_count((640, 480)) == theirs._get_num_multimodal_tokens([(480, 640)]).num_image_tokens[0]


@pytest.mark.parametrize("processor, preprocessor", [
    ({"image_processor": QWEN}, QWEN_HUB),
    ({"processor_class": "Qwen2VLProcessor"}, QWEN_HUB),
    (None, QWEN_HUB),
    (None, {"image_processor_type": "Qwen2VLImageProcessor"}),  # transformers' class defaults
    (None, {**QWEN, "max_pixels": 100352}),  # max_pixels overrides size.longest_edge
], ids=["nested-over-legacy", "flat-processor-config", "legacy-min-max-pixels", "defaults", "override"])
def test_qwen_precedence_is_transformers(tmp_path, tiny_model_dirs, processor, preprocessor):
    from transformers import AutoImageProcessor

    path = folder(tmp_path, "qwen2_vl", processor, preprocessor, tiny_model_dirs["qwen2_vl"])
    family = load_family(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    for width, height in SIZES + [(1920, 1080)]:
        image = Image.new("RGB", (width, height))
        grid = image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        assert family.visual_token_count((width, height)) == int(grid.prod()) // image_processor.merge_size ** 2


CANNOT = "processor built from these settings cannot count"


@pytest.mark.parametrize("model_type, processor, preprocessor, match", [
    ("llava", None, None, r"no image processor settings.*processor_config\.json.*preprocessor_config\.json"),
    ("qwen2_vl", {"processor_class": "Qwen2VLProcessor"}, None, r"no image processor settings"),
    ("llava", None, CLIP, rf"preprocessor_config\.json: the llava {CANNOT}"),  # no patch_size for LlavaProcessor
    ("llava", LLAVA_KEYS, {**CLIP, "crop_size": {"height": 112, "width": 0}}, r"gives a 224x224 image 0 tokens"),
    ("qwen2_vl", {"image_processor": {**QWEN, "size": {"shortest_edge": 3136}}}, None,
     rf"processor_config\.json \(.image_processor. entry\): the qwen2_vl {CANNOT}"),
    ("qwen2_vl", None, {**QWEN, "patch_size": "14"}, rf"preprocessor_config\.json: the qwen2_vl {CANNOT}"),
    ("qwen2_vl", {"image_processor": [QWEN]}, None, r"\"image_processor\" entry\) is list"),
], ids=["none", "no-entry-no-legacy", "no-patch-size", "zero-crop", "no-longest-edge", "str-patch",
        "entry-not-object"])
def test_missing_or_bad_settings_name_the_file(tmp_path, tiny_model_dirs, model_type, processor, preprocessor, match):
    path = folder(tmp_path, model_type, processor, preprocessor, tiny_model_dirs[model_type])
    with pytest.raises(CheckpointError, match=match):
        load_family(path)


def test_invalid_json_names_the_file(tmp_path, tiny_model_dirs):
    path = folder(tmp_path, "llava", None, CLIP, tiny_model_dirs["llava"])
    (path / "processor_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"processor_config\.json is not valid JSON"):
        load_family(path)


def test_worker_sizes_images_with_admissions_processor(tiny_model_dirs):
    """Admission's count and the worker's pixels come from one image processor object: they cannot disagree."""
    from mserve.workers.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dirs["qwen2_vl"], num_blocks=4, dtype="float32")
    assert runner.image_processor is runner.family.processor.image_processor
