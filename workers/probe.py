"""The load-time exactness probe: a family without tests here serves only once its engine tokens equal HF's.

Before a worker of an untested family says READY, fixed cases (text only; one image at two sizes;
two images; a prefill chunk ending inside an image; a prefix-cache hit) run through the checkpoint's
own `generate(do_sample=False)` and then through the engine (workers/engine.py, the path the worker
serves), on ONE load of the weights: HF runs first, on the model as transformers loaded it; then the
engine takes the same object (it packs the linears in place, so HF never runs after it). Any token
that differs refuses the checkpoint, naming the case, the position and both tokens (workers/verdicts.py
caches the verdict per checkpoint content, dtype and mserve version).
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from mserve.common.model import load_family
from mserve.common.processor import UnsupportedModelError
from mserve.common.exactness import compare_greedy
from mserve.common.prompt import PromptBuilder
from mserve.common.traits import read_traits
from mserve.common.checkpoint_files import read_model_config

MAX_NEW_TOKENS = 8


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    image_sizes: tuple[tuple[int, int], ...] = ()
    chunk_inside_image: bool = False  # the prefill runs in chunks, the first ending inside the first image
    prefix_of: str | None = None  # this case runs after that case's request, on the same engine: a prefix hit


CASES = (
    Case("text only", "Tell me a story about a small robot who learns to paint."),
    Case("one image (small)", "Describe the picture.", ((64, 48),)),
    Case("one image (large)", "Describe the picture.", ((200, 150),)),
    Case("two images", "Compare the two pictures.", ((120, 90), (80, 100))),
    Case("chunk ends inside an image", "What is in this image?", ((160, 120),), chunk_inside_image=True),
    Case("prefix hit", "What is in this image? Answer in one word.", ((160, 120),),
         prefix_of="chunk ends inside an image"),
)


@dataclass
class CaseResult:
    name: str
    prompt_tokens: int
    expected: list[int]
    produced: list[int]
    compared: int  # tokens compared (all, or up to and including a bf16 tie)
    hf_seconds: float
    engine_seconds: float
    detail: str = ""  # the chunk sizes or the prefix tokens the case really exercised
    mismatch: int | None = None  # first position that differs outside a tie

    @property
    def ok(self) -> bool:
        return self.mismatch is None


@dataclass
class Verdict:
    model_type: str
    dtype: str
    served: bool
    reason: str
    traits: dict[str, Any]
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for case, result in zip(out["cases"], self.cases):
            case["ok"] = result.ok
        return out


def probe_image(width: int, height: int, seed: int) -> bytes:
    """A fixed image: a gradient with seeded noise, so different images embed differently."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    arr = np.clip(base * 0.75 + rng.integers(0, 64, size=(height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def compare(expected: Sequence[int], produced: Sequence[int], top2: Sequence[tuple[float, float]],
            dtype: str) -> tuple[int | None, int]:
    """(first position that differs where it counts, tokens compared), by the one exactness rule
    (common/exactness.py): float32 token for token; reduced precision up to HF's first top-2 tie."""
    v = compare_greedy(expected, produced, top2, dtype)
    return (None if v.exact else v.first_difference), (v.compared if v.exact else v.first_difference + 1)


class CaseFailed(Exception):
    """A case could not run at all (HF or the engine raised): the checkpoint is refused, naming both."""


def _named(case: Case, who: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # any failure of an unproven family is a refusal, not a crash
        raise CaseFailed(f"case {case.name!r}: {who} failed ({type(exc).__name__}: {exc})") from exc


class Probe:
    """Runs the cases on one checkpoint: HF first, then the engine on the same weights."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS) -> None:
        from mserve.workers.model_loading import resolve_dtype

        self.model_dir, self.device = str(model_dir), device
        self.dtype = resolve_dtype(device, dtype, model_dir)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.max_new_tokens = max_new_tokens
        self.builder = PromptBuilder(model_dir)
        self.family = self.builder.family
        # A prefix case takes its base case's images: the hit covers them (block hashes key on the image).
        seeds = {c.name: 7 * i for i, c in enumerate(CASES)}
        self.prompts = {c.name: self.builder.prepare_text(
            c.prompt, [probe_image(w, h, seed=seeds[c.prefix_of or c.name] + k) for k, (w, h) in enumerate(c.image_sizes)])
            for c in CASES}

    def run(self) -> list[CaseResult]:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
        reference = {c.name: _named(c, "Hugging Face generate", self._hf, model, c) for c in CASES}
        self._ready_for_engine(model)
        results: list[CaseResult] = []
        engines: dict[str, Any] = {}
        for case in CASES:
            (expected, top2, hf_s), pp = reference[case.name], self.prompts[case.name]
            engine = engines[case.prefix_of] if case.prefix_of else _named(case, "the engine", self._engine, model, case)
            engines[case.name] = engine
            start = time.perf_counter()
            produced, detail = _named(case, "the engine", self._engine_run, engine, case, pp)
            mismatch, compared = compare(expected, produced, top2, self.dtype_name)
            results.append(CaseResult(case.name, len(pp.prompt_ids), expected, produced, compared, hf_s,
                                      time.perf_counter() - start, detail, mismatch))
        return results

    def prompt_error(self, pp) -> str:
        """Where mserve's prompt ids (admission's count, placeholders expanded) differ from the ids the
        checkpoint's own processor makes of the same rendered text and images; "" when equal."""
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in pp.images]
        try:
            out = self.family.processor(text=[pp.text], images=pil or None, add_special_tokens=False)
        except Exception as exc:  # transformers raises many types; the user reads which
            return f"the processor cannot run on this prompt ({type(exc).__name__}: {exc})"
        theirs = list(out["input_ids"][0])
        bos = self.builder.bos_token_id
        if bos is not None and (not theirs or theirs[0] != bos):
            theirs = [bos] + theirs  # the BOS its tokenizer adds itself (PromptBuilder._implicit_bos)
        ours = list(pp.prompt_ids)
        if ours == theirs:
            return ""
        i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        return (f"prompt token {i} differs from the processor's own ids (processor "
                f"{theirs[i] if i < len(theirs) else 'end'}, mserve {ours[i] if i < len(ours) else 'end'})")

    # -- Hugging Face -------------------------------------------------------------------------
    @torch.inference_mode()
    def _hf(self, model, case: Case) -> tuple[list[int], list[bool], float]:
        """HF's greedy tokens and, per step, its top-2 logits (common/exactness.py tells a tie from them)."""
        import copy
        import inspect

        pp = self.prompts[case.name]
        ids = torch.tensor([list(pp.prompt_ids)], device=self.device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        params = inspect.signature(model.forward).parameters
        # The model inputs besides the ids are the checkpoint processor's own, not mserve's preparation
        # (family.image_inputs, which the engine uses): a difference between the two shows in the tokens.
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in pp.images]
        inputs = self.family.processor(text=[pp.text], images=pil or None, add_special_tokens=False, return_tensors="pt")
        kwargs.update({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()
                       if k in params and k not in kwargs})
        kwargs.update({k: v.to(self.family.rules.pixel_dtype(self.dtype)) for k, v in kwargs.items()
                       if k.startswith("pixel_values") and torch.is_tensor(v) and v.is_floating_point()})
        for name in ("mm_token_type_ids", "token_type_ids"):  # for a processor that does not return them
            if name in params and name not in kwargs:
                kwargs[name] = (ids == self.family.image_token_id).int()
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.do_sample = self.max_new_tokens, False
        config.output_logits, config.return_dict_in_generate = True, True
        start = time.perf_counter()
        out = model.generate(**kwargs, generation_config=config)
        seconds = time.perf_counter() - start
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        top2 = [tuple(logits[0].float().topk(2).values.tolist()) for logits in out.logits]
        return tokens, top2, seconds

    # -- the engine ---------------------------------------------------------------------------
    def _ready_for_engine(self, model) -> None:
        """What load_vlm does to a loaded model before an engine runs it (model_runner.py)."""
        from mserve.workers.model_loading import use_paged_attention
        from mserve.workers.vision_layers import drop_unread_vision_layers

        drop_unread_vision_layers(model)
        use_paged_attention(model)

    def _engine(self, model, case: Case):
        from mserve.workers.engine import Engine, EngineConfig

        budget = 4096
        if case.chunk_inside_image:
            spans = self.family.image_spans(self.prompts[case.name].prompt_ids)
            start, length = spans[0]
            budget = start + max(1, length // 2)  # the first chunk stops halfway through the image
        # Room for the longest case twice over (a prefix case shares its base case's engine), whatever the
        # checkpoint's image token count: 576 a LLaVA-1.5 image makes two images 1,175 tokens.
        longest = max(len(pp.prompt_ids) for pp in self.prompts.values()) + self.max_new_tokens
        num_blocks = max(256, 2 * -(-longest // 4) + 16)
        return Engine(EngineConfig(self.model_dir, device=self.device, dtype=self.dtype_name, num_blocks=num_blocks, block_size=4,
                                   max_num_batched_tokens=budget), model=model)

    def _engine_run(self, engine, case: Case, pp) -> tuple[list[int], str]:
        from mserve.workers.sequence import SamplingParams

        seq = engine.add_request(case.name, pp.prompt_ids, images=pp.images,
                                 sampling=SamplingParams(max_tokens=self.max_new_tokens))
        chunks: list[int] = []
        tokens: list[int] = []
        while engine.has_unfinished():
            before = seq.num_computed_tokens
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            if before < len(pp.prompt_ids):
                chunks.append(seq.num_computed_tokens - before)
        detail = f"prefill chunks {chunks}" if len(chunks) > 1 else ""
        if case.prefix_of:
            detail = f"{seq.num_cached_tokens} prompt tokens from the prefix cache"
        return tokens, detail


def failure(results: Sequence[CaseResult]) -> str | None:
    """The first failed case in one line: the case, the position, HF's token and the engine's."""
    for r in results:
        if not r.ok:
            want = r.expected[r.mismatch] if r.mismatch < len(r.expected) else "end of output"
            got = r.produced[r.mismatch] if r.mismatch < len(r.produced) else "end of output"
            return (f"case {r.name!r}: token {r.mismatch} differs from Hugging Face generate "
                    f"(expected {want}, produced {got})")
    return None


def verify(model_dir: str, device: str = "cpu", dtype: str | None = None) -> Verdict:
    """The probe's verdict on one checkpoint (no cache): refused at once for a trait the engine lacks."""
    from mserve.workers.model_loading import resolve_dtype

    start = time.perf_counter()
    cfg = read_model_config(model_dir)
    traits = read_traits(cfg)
    name = str(resolve_dtype(device, dtype, model_dir)).removeprefix("torch.")

    def refused(reason: str) -> Verdict:
        return Verdict(str(cfg.get("model_type")), name, False, reason, traits.describe(),
                       seconds=time.perf_counter() - start)

    try:
        load_family(model_dir)
    except UnsupportedModelError as exc:
        return refused(str(exc))
    try:
        runner = Probe(model_dir, device, dtype)
    except Exception as exc:  # an unproven family whose prompts cannot even be built is refused, not a crash
        return refused(f"the probe's prompts cannot be built ({type(exc).__name__}: {exc})")
    # Admission first: its ids must be the processor's before HF or the engine is given them.
    for case in CASES:
        if why := runner.prompt_error(runner.prompts[case.name]):
            return refused(f"case {case.name!r}: {why}")
    try:
        results = runner.run()
    except CaseFailed as exc:
        return refused(str(exc))
    why = failure(results)
    return Verdict(traits.model_type, name, why is None, why or "every case equals Hugging Face generate",
                   traits.describe(), results, time.perf_counter() - start)
