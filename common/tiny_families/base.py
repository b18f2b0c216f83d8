"""What every tiny-model family shares: the offline tokenizer training and the weight draw.

Nothing here names a family; each family's module (llava.py, qwen.py, ...) says what it is made of.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PATCH_SIZE = 14

# Final vocabulary size, special tokens included.
VOCAB_SIZES = {"tiny": 1000, "small": 4000}


@dataclass(frozen=True)
class TinyFamily:
    """One architecture `mserve make-tiny-model --arch NAME` builds: its layer shapes and weight scale
    per size, and how its tokenizer, config, processor files and generation config are made."""

    arch: str
    dims: dict[str, dict[str, Any]]  # size -> layer shapes
    init_std: dict[str, float]  # size -> std of the N(0, std) weight draw
    tokenizer: Callable[[int], Any]  # vocab size -> PreTrainedTokenizerFast
    config: Callable[[dict, Any, float], Any]  # (dims, tokenizer, std) -> transformers config
    save_processor: Callable[[Path, dict, Any, str], None]  # (folder, dims, tokenizer, layout)
    generation_config: Callable[[Any], Any]  # tokenizer -> GenerationConfig
    # The transformers auto class that builds it: an audio-language model is no image-text-to-text one.
    model_class: str = "AutoModelForImageTextToText"

# Tokenizer training corpus: docstrings of a fixed list of stdlib modules (offline, and
# identical on every run with the same Python) plus a few plain English sentences.
_CORPUS_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses "
    "datetime decimal difflib email.message enum fractions functools gzip hashlib heapq http.client "
    "inspect io ipaddress itertools json logging mimetypes operator os pathlib pickle pprint queue "
    "random re sched shlex shutil socket sqlite3 statistics string struct subprocess tarfile tempfile "
    "textwrap threading typing unittest urllib.parse urllib.request uuid warnings weakref zipfile"
).split()
_ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "What is shown in this image? Describe the picture in detail.",
    "A cat is sitting on a red sofa next to a window.",
    "There are two people walking along the beach at sunset.",
    "Please answer the question briefly and accurately.",
    "The image shows a city street with cars, buses and a traffic light.",
]


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    docs = list(_ENGLISH)
    with warnings.catch_warnings():  # reading e.g. typing.io.__doc__ warns on some Pythons
        warnings.simplefilter("ignore")
        for name in _CORPUS_MODULES:
            module = importlib.import_module(name)
            docs.append(inspect.getdoc(module) or "")
            for attr in sorted(vars(module)):  # sorted: dict order must not leak into the corpus
                obj = getattr(module, attr)
                if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__:
                    docs.append(inspect.getdoc(obj) or "")
    return tuple(d for d in docs if d)


def train_bpe(vocab_size: int, trained_specials: list[str], added_specials: list[str]) -> Tokenizer:
    """Byte-level BPE with ``trained_specials`` at the front of the vocab and
    ``added_specials`` appended at the end (the layout of the real checkpoints)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=trained_specials,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(added_specials)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Weights N(0, std), biases 0, norm scales 1.  A private generator keeps the result a
    function of ``seed`` alone and leaves the caller's global RNG untouched."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1 and "embedding" not in name:  # LayerNorm / RMSNorm scales
                param.fill_(1.0)
            else:  # matrices, conv kernels, embeddings, CLIP's class_embedding vector
                param.copy_(torch.randn(param.shape, generator=gen) * std)


class SubProcessorStandIn(dict):
    """Stands in for a sub-processor whose class needs torchvision (a video processor such as
    Qwen2VLVideoProcessor, Llama 4's image processor): ProcessorMixin.save_pretrained writes a sub-processor
    that is a plain dict as it is (and skips custom-code saving: no auto class)."""

    _auto_class = None

    def save_pretrained(self, out: Path) -> None:
        """The settings as an image processor saves its own (preprocessor_config.json, the hub's older layout)."""
        (Path(out) / "preprocessor_config.json").write_text(json.dumps(self, indent=2, sort_keys=True) + "\n")


def with_stand_ins(cls: type, stand_ins: dict[str, dict], **parts: Any) -> Any:
    """A real `cls` processor whose sub-processors named in `stand_ins` are SubProcessorStandIns of those settings.

    ProcessorMixin.__init__ type-checks every sub-processor, and without torchvision the check of such a
    class cannot even run, so those checks are skipped for this one instance."""
    processor = cls.__new__(cls)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = (
        lambda name, arg: dict if name in stand_ins else check(name, arg))
    processor.__init__(**{name: SubProcessorStandIn(config) for name, config in stand_ins.items()}, **parts)
    del processor.check_argument_for_proper_class
    return processor


def with_video_stand_in(cls: type, video_config: dict, **parts: Any) -> Any:
    """A real `cls` processor whose video processor is a SubProcessorStandIn of `video_config`."""
    return with_stand_ins(cls, {"video_processor": video_config}, **parts)


def save_processor_files(out: Path, processor: Any, image_processor: Any, layout: str) -> None:
    """The processor's files in one of common/tiny_model.py's LAYOUTS: processor_config.json (image
    processor nested), tokenizer and chat template always; the image processor's own
    preprocessor_config.json, as on the hub, unless `layout` is "processor"; and for "preprocessor",
    the hub's older layout, processor_config.json keeps the processor's own keys only."""
    processor.save_pretrained(out)
    if layout != "processor":
        image_processor.save_pretrained(out)
    if layout == "preprocessor":
        path = out / "processor_config.json"
        config = json.loads(path.read_text())
        del config["image_processor"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
