"""Test factories: images, prompts, and the Hugging Face `generate` oracle every greedy path must match."""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
from PIL import Image


def make_image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A deterministic image: a smooth gradient plus seeded noise, so different seeds embed differently."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = np.clip(base * 0.75 + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


PROMPTS = [
    "Describe the picture.",
    "What is in this image? Answer in one short sentence please.",
    "List three colours you can see, and say which one covers the largest area of the image.",
    "Hi",
    "Tell me a story about a small robot who learns to paint landscapes near the sea at dawn.",
    "Compare the two halves of the image.",
    "Is this a photograph or a drawing?",
    "Count the objects.",
    "Write a haiku about it.",
    "What would you change to make it brighter, warmer and more inviting to look at?",
]


def reference_model(model_dir: str, dtype: str = "float32"):
    """A separate, untouched copy of the checkpoint for Hugging Face generate(), loaded in `dtype`: one
    object per (folder, dtype), however it is asked for (a test may patch the very model generate runs)."""
    return _reference_model(str(model_dir), dtype)


# A session asks for more than 8 (folder, dtype) pairs (ten tiny families, bf16 copies, tests' own checkpoints),
# module after module: with room for 8, the family tests evicted LLaVA and Qwen2-VL and the next modules loaded
# them again. Tiny checkpoints are about 1 MB each.
@lru_cache(maxsize=32)
def _reference_model(model_dir: str, dtype: str):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from mserve.common.families import rules_for

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if rules_for(model.config.model_type).no_images is not None:  # Llama 4: its image processor needs torchvision
        return model, None
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return model, processor


def hf_generate(model_dir: str, prompt_ids: Sequence[int], images: Sequence[bytes], max_new_tokens: int,
                ignore_eos: bool = False, dtype: str = "float32") -> list[int]:
    """Greedy token ids from transformers' own generate() on the same prompt ids and images.

    ignore_eos: EOS does not stop generation (it can still be picked), as in vLLM and our engine.
    dtype: the reference model's weights ("bfloat16" for the engine's bf16 path).
    """
    return list(_hf_generate(str(model_dir), tuple(prompt_ids), tuple(images), max_new_tokens, ignore_eos, dtype)[0])


def hf_generate_top2(model_dir: str, prompt_ids: Sequence[int], images: Sequence[bytes], max_new_tokens: int,
                     ignore_eos: bool = False, dtype: str = "float32") -> tuple[list[int], list[tuple[float, float]]]:
    """hf_generate's ids and, per step, HF's two largest logits: what common/exactness.compare_greedy
    needs to tell a reduced-precision tie from a wrong token."""
    ids, top2 = _hf_generate(str(model_dir), tuple(prompt_ids), tuple(images), max_new_tokens, ignore_eos, dtype)
    return list(ids), list(top2)


@lru_cache(maxsize=1024)
def _hf_generate(model_dir: str, prompt_ids: tuple[int, ...], images: tuple[bytes, ...], max_new_tokens: int,
                 ignore_eos: bool, dtype: str = "float32"):
    """(generated ids, each step's top-2 logits), both tuples."""
    import copy

    model, processor = reference_model(model_dir, dtype)
    ids = torch.tensor([list(prompt_ids)])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        kwargs.update(_model_image_inputs(model, processor(images=pil, return_tensors="pt", **_image_kwargs(model.config))))
    if _uses_mrope(model.config) or model.config.model_type == "gemma4":  # the rope index; Gemma 4: its image groups
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    if model.config.model_type == "gemma3":  # as Gemma3Processor returns them: 1 on image soft tokens
        kwargs["token_type_ids"] = (ids == model.config.image_token_id).int()
        kwargs.pop("num_crops", None)  # pan-and-scan's crop counts (off): not a model input
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    if ignore_eos:  # an empty list, not None: generate() fills a None from the model's own generation_config
        config.eos_token_id = []
    config.output_logits, config.return_dict_in_generate = True, True
    with torch.inference_mode():
        out = model.generate(**kwargs, generation_config=config)
    top2 = tuple(tuple(step[0].float().topk(2).values.tolist()) for step in out.logits)
    return tuple(out.sequences[0, ids.shape[1]:].tolist()), top2


def _uses_mrope(config) -> bool:
    """M-RoPE, as mserve.common.model.ModelFamily.uses_mrope reads it from the text config."""
    rope = getattr(config.get_text_config(), "rope_parameters", None) or {}
    return "mrope_section" in rope


def _image_kwargs(config) -> dict:
    """What the checkpoint's processor passes its image processor beyond its saved settings:
    PixtralProcessor resizes to multiples of the merged patch (patch_size * spatial_merge_size)."""
    if config.model_type == "mistral3":
        return {"patch_size": config.vision_config.patch_size * config.spatial_merge_size}
    return {}


def _model_image_inputs(model, inputs) -> dict:
    """The image processor's outputs the model's forward takes (pixel_values and image_grid_thw / image_sizes
    / pixel_attention_mask), without its bookkeeping (InternVL's num_patches, SmolVLM's rows and cols)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {k: v for k, v in inputs.items() if k in params}


def hf_generate_visual(model_dir: str, prompt_ids: Sequence[int], items: Sequence, max_new_tokens: int,
                       video_metadata: Sequence[dict] | None = None) -> list[int]:
    """hf_generate for prompts with videos. `items`: image bytes, or a video as a list of frame bytes, in
    prompt order. Qwen2-VL gets each video as pixel_values_videos / video_grid_thw
    (built by mserve's own video preprocessing: transformers' video processor needs torchvision) and
    mm_token_type_ids 2 on video tokens; LLaVA gets every frame as an image, in order. Qwen2.5-VL also
    gets second_per_grid_ts as its processor computes it from each video's transformers VideoMetadata
    (`video_metadata`, one dict per video; default: what transformers assumes for a bare frame list)."""
    key = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in items)
    meta = tuple(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in m.items()))
                 for m in video_metadata or ())
    return list(_hf_generate_visual(str(model_dir), tuple(prompt_ids), key, max_new_tokens, meta)[0])


def _second_per_grid_ts(videos: list, metadata: tuple, temporal_patch_size: int) -> torch.Tensor:
    """Qwen2_5_VLProcessor._process_videos's rule: temporal_patch_size / the VideoMetadata's sampled_fps
    (its own make_batched_metadata default for a frame list without metadata)."""
    from transformers.video_utils import VideoMetadata

    out = []
    for k, frames in enumerate(videos):
        md = dict(metadata[k]) if k < len(metadata) else {"total_num_frames": len(frames),
                                                           "frames_indices": list(range(len(frames)))}
        md = {key: list(v) if isinstance(v, tuple) else v for key, v in md.items()}
        out.append(temporal_patch_size / VideoMetadata(**md).sampled_fps)
    return torch.tensor(out)


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


@lru_cache(maxsize=256)
def _hf_generate_visual(model_dir: str, prompt_ids: tuple[int, ...], items: tuple, max_new_tokens: int,
                        metadata: tuple = ()):
    """(generated ids, each step's top-2 logits), as _hf_generate."""
    import copy

    from mserve.common.model import load_family
    from mserve.workers.video_processing import qwen_video_inputs

    model, processor = reference_model(model_dir)
    family = load_family(model_dir)
    ids = torch.tensor([list(prompt_ids)])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    videos = [[_pil(f) for f in x] for x in items if isinstance(x, tuple)]
    if family.video_as_frames:
        images = [_pil(f) for x in items for f in (x if isinstance(x, tuple) else (x,))]
        videos = []
    else:
        images = [_pil(x) for x in items if not isinstance(x, tuple)]
    if images:
        kwargs.update(_model_image_inputs(model, processor(images=images, return_tensors="pt", **_image_kwargs(model.config))))
    if videos:
        kwargs.update(qwen_video_inputs(processor, family, videos))
        if family.model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = _second_per_grid_ts(videos, metadata, family.video_config["temporal_patch_size"])
    if family.uses_mrope:
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    config.output_logits, config.return_dict_in_generate = True, True
    with torch.inference_mode():
        out = model.generate(**kwargs, generation_config=config)
    top2 = tuple(tuple(step[0].float().topk(2).values.tolist()) for step in out.logits)
    return tuple(out.sequences[0, ids.shape[1]:].tolist()), top2


def make_frames(width: int, height: int, count: int, seed: int = 0, fmt: str = "PNG") -> list[bytes]:
    """A deterministic clip: `count` frames of one size, a gradient drifting a few pixels per frame plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for k in range(count):
        base = np.stack([(x + 5 * k) * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y + 9 * k) % 256], -1)
        arr = np.clip(base * 0.75 + rng.integers(0, 64, size=(height, width, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt)
        frames.append(buf.getvalue())
    return frames


def make_video_file(frames: list[bytes], fps: int = 2) -> bytes:
    """An mp4 (MPEG-4 part 2, FFmpeg's built-in encoder) of these frames at `fps` (needs PyAV)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        first = Image.open(io.BytesIO(frames[0]))
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = first.width, first.height, "yuv420p"
        for f in frames:
            frame = av.VideoFrame.from_image(Image.open(io.BytesIO(f)).convert("RGB"))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def chat(text: str, images: Sequence[bytes] = ()) -> list[dict]:
    """One user turn in the OpenAI shape: images first, then the text."""
    return [{"role": "user", "content": [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]}]


def request_mix(n: int, seed: int = 0) -> list[tuple[str, list[bytes]]]:
    """n (text, images) pairs cycling text-only, one image and two images, of varied sizes."""
    mix = []
    for i in range(n):
        k = i % 3
        images = [make_image(96 + 53 * ((i + j) % 7), 80 + 41 * ((i * 3 + j) % 5), seed=seed * 1000 + 10 * i + j)
                  for j in range(k)]
        mix.append((PROMPTS[i % len(PROMPTS)], images))
    return mix


def wait_for(condition, timeout_s: float = 10.0, what: str = "a condition", every_s: float = 0.05):
    """Poll `condition` until it returns something truthy (returned) or `timeout_s` passes (AssertionError)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def import_without_torchvision(name: str):
    """A transformers video processor module, imported with torchvision (not installed here) stubbed out:
    only its torch-only functions (patch counts, frame sampling, patchify) may be called."""
    import importlib
    import sys
    import types

    for dep in ("transformers.video_processing_utils", "transformers.video_utils", "transformers.processing_utils",
                "transformers.image_utils"):
        importlib.import_module(dep)  # their torchvision checks run before the stub exists
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    if any(n in sys.modules for n in names):  # torchvision is really there
        return importlib.import_module(name)
    sys.modules.update({n: types.ModuleType(n) for n in names})
    try:
        return importlib.import_module(name)
    finally:
        for n in names:
            sys.modules.pop(n, None)


def make_pdf(sizes: Sequence[tuple[int, int]], seed: int = 0) -> bytes:
    """A PDF (Pillow writes it) whose pages are make_image(w, h, seed + i) at 72 DPI: each page w x h points."""
    pages = [Image.open(io.BytesIO(make_image(w, h, seed=seed + i))).convert("RGB") for i, (w, h) in enumerate(sizes)]
    buf = io.BytesIO()
    pages[0].save(buf, format="PDF", save_all=True, append_images=pages[1:], resolution=72.0)
    return buf.getvalue()
