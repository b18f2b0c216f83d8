"""Hugging Face generate() on each audio family's own processor inputs: the oracle of the audio tests.

Qwen2-Audio gets Qwen2AudioProcessor on mserve's rendered text, Voxtral VoxtralProcessor.apply_chat_template on
the same turn, Gemma 4 Gemma4Processor on the rendered text, images and clips; every clip is the waveform the
engine decodes (common/audio.py: decode_audio), and the processor's ids must equal mserve's prompt ids (so
admission's count is the processor's). One generate per distinct input in a session: a test asking for inputs
another test (or a cluster test) already ran gets the same tokens without running the model again.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from mserve.common.audio import decode_audio
from tests.helpers import reference_model

MAX_NEW = 8


@dataclass(frozen=True)
class Generated:
    ids: list[int]
    top2: list[tuple[float, float]]  # each step's two highest logits (common/exactness.py reads them)


@lru_cache(maxsize=4)
def _model_and_processor(model_dir: str, dtype: str = "float32"):
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    if json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "gemma4":
        return reference_model(model_dir, dtype)[0], None  # the image tests' copy: one load for both
    model = AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def _digest(inputs) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype), hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest())
                 if isinstance(v, torch.Tensor) else (k, repr(v)) for k, v in sorted(inputs.items()))


_GENERATED: dict[tuple, Generated] = {}


def generate(model_dir: str, inputs, max_new: int = MAX_NEW, dtype: str = "float32") -> Generated:
    """Greedy generate on `inputs` as they are, once per (checkpoint, dtype, inputs, length) in a session."""
    key = (str(model_dir), dtype, max_new, _digest(inputs))
    if key not in _GENERATED:
        model, _ = _model_and_processor(str(model_dir), dtype)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, output_logits=True,
                                 return_dict_in_generate=True)
        _GENERATED[key] = Generated(out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
                                    [tuple(step[0].float().topk(2).values.tolist()) for step in out.logits])
    hit = _GENERATED[key]
    return Generated(list(hit.ids), list(hit.top2))


def _checked(inputs, pp):
    assert inputs["input_ids"][0].tolist() == pp.prompt_ids  # admission's count is the processor's
    return inputs


def qwen2_audio_inputs(model_dir: str, pp):
    _, processor = _model_and_processor(str(model_dir))
    rate = processor.feature_extractor.sampling_rate
    clips = [decode_audio(part.data, rate, part.samples) for part in pp.images]
    return _checked(processor(text=pp.text, audio=clips or None, sampling_rate=rate, return_tensors="pt"), pp)


def qwen2_audio_features(model_dir: str, pp) -> dict:
    """The feature extractor's inputs for pp's clips alone (a second turn's ids come from elsewhere)."""
    _, processor = _model_and_processor(str(model_dir))
    rate = processor.feature_extractor.sampling_rate
    features = processor.feature_extractor([decode_audio(p.data, rate, p.samples) for p in pp.images],
                                           sampling_rate=rate, padding="max_length", return_attention_mask=True,
                                           return_tensors="pt")
    return {"input_features": features["input_features"], "feature_attention_mask": features["attention_mask"]}


def hf_generate_audio(model_dir: str, pp, max_new: int = MAX_NEW) -> list[int]:
    """Qwen2-Audio: HF generate on the processor's own inputs for pp's rendered text and clips."""
    return generate(model_dir, qwen2_audio_inputs(model_dir, pp), max_new).ids


def voxtral_inputs(model_dir: str, pp, text: str):
    """VoxtralProcessor's own inputs for one user turn of pp's clips (as the engine decodes them) and text; a
    turn without clips is the plain string content."""
    import soundfile

    _, processor = _model_and_processor(str(model_dir))
    rate = processor.feature_extractor.sampling_rate
    content = []
    for part in pp.images:
        buf = io.BytesIO()
        soundfile.write(buf, decode_audio(part.data, rate, part.samples), rate, format="WAV", subtype="FLOAT")
        content.append({"type": "audio", "base64": base64.b64encode(buf.getvalue()).decode()})
    turn = content + [{"type": "text", "text": text}] if content else text
    return _checked(processor.apply_chat_template([{"role": "user", "content": turn}]), pp)


def voxtral_generate(model_dir: str, pp, text: str) -> list[int]:
    return generate(model_dir, voxtral_inputs(model_dir, pp, text)).ids


def gemma4_inputs(builder, pp) -> dict:
    """Gemma4Processor's own inputs for pp's rendered text, images and clips."""
    from PIL import Image

    processor = builder.family.processor
    rate = processor.feature_extractor.sampling_rate
    clips = [decode_audio(p.data, rate, p.samples) for p in pp.images if not isinstance(p, bytes)]
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pp.images if isinstance(p, bytes)]
    return _checked(processor(text=pp.text, images=images or None, audio=clips or None, add_special_tokens=False,
                              return_tensors="pt"), pp)


def gemma4_generate(model_dir: str, inputs: dict) -> list[int]:
    return generate(model_dir, inputs).ids
