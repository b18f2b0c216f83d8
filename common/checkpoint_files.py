"""Reads the settings a checkpoint folder was saved with, where transformers reads them, and checks them.

config.json (the model's), and the image processor's settings (which file wins, below); errors name
the file and the key (CheckpointError), never a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder lacks, or has malformed, settings that serving needs (names the file)."""


def read_model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder: no config.json")
    return json.loads(path.read_text())


# Where transformers finds the image processor's settings. AutoImageProcessor.from_pretrained (and so
# ProcessorMixin.from_pretrained / AutoProcessor, which load their image processor through it) reads
# them in ImageProcessingMixin.get_image_processor_dict: the "image_processor" entry of
# processor_config.json (what ProcessorMixin.save_pretrained writes in transformers 5.x) wins;
# without that entry, preprocessor_config.json (ImageProcessingMixin.save_pretrained, the hub layout).
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def read_image_processor_config(model_dir: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(image processor settings, where they came from), found the way transformers finds them."""
    d = Path(model_dir)
    processor = read_json(d / PROCESSOR_FILE)
    if processor is not None and "image_processor" in processor:
        where = f'{d / PROCESSOR_FILE} ("image_processor" entry)'
        if not isinstance(processor["image_processor"], dict):
            raise CheckpointError(f"{where} is {type(processor['image_processor']).__name__}, not an object")
        return dict(processor["image_processor"]), where
    legacy = read_json(d / IMAGE_PROCESSOR_FILE)
    if legacy is not None:
        return legacy, str(d / IMAGE_PROCESSOR_FILE)
    raise CheckpointError(
        f"{model_dir} has no image processor settings: transformers reads them from the \"image_processor\" "
        f"entry of {PROCESSOR_FILE}, else from {IMAGE_PROCESSOR_FILE}, and neither is there")


def pixel_bounds(proc: dict[str, Any], default_size: dict[str, int], where: str) -> None:
    """min_pixels / max_pixels from size (or the class default), overridden by explicit min_pixels / max_pixels."""
    size = proc.get("size")
    size = dict(default_size) if size is None else size
    if not isinstance(size, dict):
        raise CheckpointError(f"{where}: size must be an object with shortest_edge / longest_edge, got {size!r}")
    size = dict(size)
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if proc.get(key) is not None:
            size[edge] = proc[key]
        proc[key] = positive_int(size.get(edge), f"{key} (size.{edge})", where)
    if proc["min_pixels"] > proc["max_pixels"]:
        raise CheckpointError(f"{where}: min_pixels {proc['min_pixels']} is over max_pixels {proc['max_pixels']}")


def positive_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value
