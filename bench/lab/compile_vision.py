"""torch.compile (inductor, CPU) of the vision tower and projector, against the eager forward a worker runs.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.compile_vision --model /work/peers/small-llava \\
        [--variants eager,compiled,compiled-kernel,compiled-kernel-frozen] [--rounds 7] [--size 1280x720]

Issue 20 asks for the vision tower compiled, kept only if the measurement says so. Each variant loads
its own encode-only ModelRunner (bf16, `--attention padded`, one torch thread) and times the model's
`get_image_features` on one image's pixel values (the image processor is not timed: a worker runs it on
its IO core), variants interleaved round by round, median ms an image:

- `eager`: what a worker runs: prepacked linear layers (workers/packed_linear.py) and the vision
  attention in the bf16 kernel (workers/paged_prefill.py) where this CPU has AVX512_BF16;
- `compiled`: `torch.compile(dynamic=False)` of the plain modules (`F.linear`, torch's SDPA), as
  `--compile` leaves a language model;
- `compiled-kernel`: the same with the kernel's vision attention as a torch custom op, so that dynamo
  traces through it (a ctypes call would break the graph at every layer; the packed linear's mkldnn op
  does not lower in inductor, so the linear layers are `F.linear`);
- `compiled-kernel-frozen`: and inductor's `freezing`, which prepacks the weights for oneDNN itself.
  `freezing` is a process-wide inductor setting: put this variant in a run of its own (with `eager`).

Also prints each variant's first call (compile included, into an empty inductor cache unless
`--keep-cache`) and its largest difference from `eager`'s output. Used for bench/lab/NOTEBOOK.md,
"Compiling the vision tower".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

VARIANTS = ("eager", "compiled", "compiled-kernel", "compiled-kernel-frozen")
ATTN = "mserve_lab_vision"
_registered = False


def _register_kernel_op() -> None:
    """The vision attention kernel as a custom op (`mserve_lab::vision_attn`) and an attention function
    for transformers that calls it."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    from mserve.workers import paged_prefill

    @torch.library.custom_op("mserve_lab::vision_attn", mutates_args=())
    def vision_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        b = q.shape[0]  # q, k, v [B, L, heads, d]; image b's keys are pool block b
        tables = torch.arange(b, dtype=torch.long).view(b, 1)
        return paged_prefill.attend(q, k.contiguous(), v.contiguous(), tables, torch.zeros(b, dtype=torch.long),
                                    scale, causal=False)

    @vision_attn.register_fake
    def _(q, k, v, scale):
        return torch.empty_like(q)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        return vision_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale), None

    AttentionInterface.register(ATTN, attention)
    _registered = True


def kernel_usable() -> bool:
    """Whether this host runs the bf16 vision attention kernel (AVX512_BF16, a compiler)."""
    from mserve.workers import paged_prefill

    q = torch.zeros(4, 16, 64, dtype=torch.bfloat16)
    return paged_prefill.usable(q, torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16))


def build(model: str, variant: str, image):
    """(call, seconds of the first call, its output) for one variant."""
    from mserve.workers.model_runner import ModelRunner

    compiled = variant != "eager"
    # compile_decode=True loads the modules as `--compile` does: no packed linear layers, no fused ops
    runner = ModelRunner(model, dtype="bfloat16", exact_attention=False, parts="vision", compile_decode=compiled)
    inputs = runner.family.image_inputs([image])
    kwargs = {k: v for k, v in inputs.items() if k in runner._image_feature_inputs}
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.bfloat16)
    vlm = runner.model.model
    fn = vlm.get_image_features
    if compiled:
        import torch._inductor.config as inductor_config

        if variant.startswith("compiled-kernel"):
            _register_kernel_op()
        vlm.config.vision_config._attn_implementation = ATTN if variant.startswith("compiled-kernel") else "sdpa"
        inductor_config.freezing = variant.endswith("frozen")
        fn = torch.compile(fn, dynamic=False)

    def call():
        with torch.inference_mode():
            return fn(**kwargs, return_dict=True).pooler_output

    t = time.perf_counter()
    out = call()
    return call, time.perf_counter() - t, out


def _flat(out):
    return torch.cat([o.float().flatten() for o in out]) if isinstance(out, (list, tuple)) else out.float().flatten()


def main(argv: list[str] | None = None) -> int:
    import torch._inductor.config as inductor_config

    p = argparse.ArgumentParser(prog="python -m lab.compile_vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a llava-family checkpoint folder (the peer's small-llava)")
    p.add_argument("--variants", default="eager,compiled,compiled-kernel",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: the first three)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5, help="forwards a round per variant (default 5)")
    p.add_argument("--size", default="1280x720", help="the image's WxH before the processor (default 1280x720)")
    p.add_argument("--keep-cache", action="store_true",
                   help="compile into the usual inductor cache (default: an empty one, so a first call is a cold start)")
    args = p.parse_args(argv)
    before, freezing = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), inductor_config.freezing
    if not args.keep_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-vision-")
    try:
        return run(args, p)
    finally:  # a caller in the same process (a test run) keeps its own cache and settings
        inductor_config.freezing = freezing
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from PIL import Image

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    if any(v.startswith("compiled-kernel") for v in variants) and not kernel_usable():
        print("the bf16 vision attention kernel does not run on this host (no AVX512_BF16, or no compiler): "
              "the kernel variants are left out")
        variants = [v for v in variants if not v.startswith("compiled-kernel")]
    w, h = (int(x) for x in args.size.lower().split("x"))
    g = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
    calls, outs = {}, {}
    for v in variants:
        calls[v], first, outs[v] = build(args.model, v, image)
        print(f"{v}: first call {first:.1f} s")
    if "eager" in outs:
        ref = _flat(outs["eager"])
        for v in (v for v in variants if v != "eager"):
            print(f"{v}: largest difference from eager {float((_flat(outs[v]) - ref).abs().max()):.3g} "
                      f"(largest eager value {float(ref.abs().max()):.3g})")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            t = time.perf_counter()
            for _ in range(args.calls):
                calls[v]()
            times[v].append((time.perf_counter() - t) / args.calls * 1e3)
    for v, ts in times.items():
        print(f"{v}: median {statistics.median(ts):.2f} ms an image (rounds: {', '.join(f'{x:.1f}' for x in ts)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
