"""Random-weight vision-language models built fully offline, for tests and benchmarks.

``make_tiny_model(out_dir, arch, size)`` writes a folder that looks like a published
Hugging Face checkpoint (config, safetensors weights, tokenizer, image processor, chat
template, generation config) so that serving code can be exercised end to end without
network access or real weights.  Only the weights and the vocabulary are synthetic; the
architectures, processors and chat templates are the real ones (each family's parts:
`common/tiny_families.py`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TINY_MODEL_ARCHS = ("llava", "qwen2_vl", "llava_next", "qwen2_5_vl")
SIZES = ("tiny", "small")

# Final vocabulary size, special tokens included.
VOCAB_SIZES = {"tiny": 1000, "small": 4000}

# Std of the N(0, std) draw for every weight matrix / embedding.  0.15 for small llava is
# fixed by the peer benchmark we compare against (and is fine for small qwen2_vl too).  At
# the tiny sizes 0.15 lets greedy decoding fall into one token repeated ~2/3 of the time
# for some seeds; 0.3 gave 12-16 distinct ids out of 16 on every seed/prompt we tried.
INIT_STD = {
    ("llava", "tiny"): 0.3,
    ("llava", "small"): 0.15,
    ("qwen2_vl", "tiny"): 0.3,
    ("qwen2_vl", "small"): 0.15,
    ("llava_next", "tiny"): 0.3,
    ("llava_next", "small"): 0.15,
    ("qwen2_5_vl", "tiny"): 0.3,
    ("qwen2_5_vl", "small"): 0.15,
}

# Layer shapes.  "small" llava must stay exactly as is: it is the benchmark model (~31.2M).
DIMS = {
    ("llava", "tiny"): dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=112,
                            hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
    ("llava", "small"): dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=336,
                             hidden=512, inter=1376, layers=8, heads=8, kv_heads=4),
    ("llava_next", "tiny"): dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, image_size=56,
                                 hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
    ("llava_next", "small"): dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, image_size=336,
                                  hidden=512, inter=1376, layers=8, heads=8, kv_heads=4),
    ("qwen2_5_vl", "tiny"): dict(v_hidden=32, v_inter=64, v_layers=2, v_heads=2, max_pixels=224 * 224,
                                 hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
    ("qwen2_5_vl", "small"): dict(v_hidden=256, v_inter=1024, v_layers=4, v_heads=4, max_pixels=448 * 448,
                                  hidden=512, inter=1376, layers=8, heads=8, kv_heads=4),
    ("qwen2_vl", "tiny"): dict(v_hidden=32, v_layers=2, v_heads=2, v_mlp_ratio=2, max_pixels=224 * 224,
                               hidden=64, inter=128, layers=2, heads=4, kv_heads=2),
    ("qwen2_vl", "small"): dict(v_hidden=256, v_layers=4, v_heads=4, v_mlp_ratio=4, max_pixels=448 * 448,
                                hidden=512, inter=1376, layers=8, heads=8, kv_heads=4),
}
PATCH_SIZE = 14

# Where the image processor's settings are written; transformers (and mserve.common.model) read
# processor_config.json's nested "image_processor" first, else preprocessor_config.json.
LAYOUTS = {
    "both": "processor_config.json with the image processor nested, plus the legacy preprocessor_config.json "
            "(and video_preprocessor_config.json for qwen2_vl); the default",
    "processor": "only what ProcessorMixin.save_pretrained writes today: the nested processor_config.json",
    "preprocessor": "the older hub layout: preprocessor_config.json; processor_config.json holds the "
                    "processor's own keys only (llava) or is absent (qwen2_vl)",
}

# Published llava-hf/llava-1.5-7b-hf chat_template.json, verbatim.  It does not emit <s>:
# as with the real checkpoint, the tokenizer's post-processor prepends BOS (and
# ProcessorMixin.apply_chat_template tokenizes with add_special_tokens left on).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] "
    "!= 'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Published Qwen/Qwen2-VL-*-Instruct chat template, verbatim (no BOS, default system prompt).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value "
    "= image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

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


def _check_choice(arch: str, size: str) -> None:
    if arch not in TINY_MODEL_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_MODEL_ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


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


def _train_bpe(vocab_size: int, trained_specials: list[str], added_specials: list[str]) -> Tokenizer:
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


def _llava_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = _train_bpe(vocab_size, ["<unk>", "<s>", "</s>"], ["<image>", "<pad>"])
    # Like the Llama tokenizer of llava-hf: BOS is prepended by the tokenizer, not the template.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"},
        padding_side="left", chat_template=LLAVA_CHAT_TEMPLATE,
    )


def _qwen2_vl_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = _train_bpe(vocab_size, [], QWEN2_VL_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        padding_side="left", chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
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


def _generation_config(tok, arch: str):
    from transformers import GenerationConfig

    if arch in ("llava", "llava_next"):
        return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
    # Qwen2-VL stops on <|im_end|> as well as <|endoftext|>, and has no real BOS.
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[tok.eos_token_id, endoftext],
                            pad_token_id=endoftext)


def make_tiny_model(out_dir: str | Path, arch: str, size: str = "tiny", seed: int = 0, layout: str = "both") -> Path:
    """Write a random-weight ``arch`` VLM checkpoint of ``size`` into ``out_dir``; return it.

    ``layout`` picks where the image processor's settings go (see ``LAYOUTS``)."""
    from transformers import AutoModelForImageTextToText

    from mserve.common import tiny_families as fam  # it imports this module's constants

    _check_choice(arch, size)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {tuple(LAYOUTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        (out / name).unlink(missing_ok=True)  # a rebuilt folder holds exactly the layout's files
    dims, std = DIMS[arch, size], INIT_STD[arch, size]

    if arch == "llava":
        tok = _llava_tokenizer(VOCAB_SIZES[size])
        config = fam.llava_config(dims, tok, std)
        fam.save_llava_processor(out, dims, tok, layout)
    elif arch == "llava_next":
        tok = _llava_tokenizer(VOCAB_SIZES[size])
        config = fam.llava_next_config(dims, tok, std)
        fam.save_llava_next_processor(out, dims, tok, layout)
    elif arch == "qwen2_5_vl":
        tok = _qwen2_vl_tokenizer(VOCAB_SIZES[size])
        config = fam.qwen2_5_vl_config(dims, tok, std)
        fam.save_qwen2_vl_processor(out, dims, tok, layout, "Qwen2_5_VLProcessor")
    else:
        tok = _qwen2_vl_tokenizer(VOCAB_SIZES[size])
        config = fam.qwen2_vl_config(dims, tok, std)
        fam.save_qwen2_vl_processor(out, dims, tok, layout)

    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _randomize(model, std, seed)
    model.generation_config = _generation_config(tok, arch)
    model.save_pretrained(out)
    return out
