"""A GPU-class cost file for the scale model, derived from stated assumptions: a model, not a measurement.

    python -m lab.sim.gpu_costs --cpu-costs cpu-small-llava --out bench/lab/costs/gpu-h100-llava7b.json

Cluster: one worker per NVIDIA H100 SXM5 80 GB, serving LLaVA-1.5-7B (CLIP ViT-L/14-336 + MLP
projector + Vicuna-7B, i.e. the Llama-2-7B architecture) in bf16. Nothing here ran on a GPU; each
number is derived below from a published figure and an efficiency assumption, and the JSON keeps
the derivation next to the value. The coordinator's CPU costs are this machine's measured ones
(copied from the CPU cost file), unchanged: a faster server core moves every coordinator ceiling
up in proportion.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Published figures (NVIDIA H100 SXM5 datasheet; Llama-2 / LLaVA-1.5 / CLIP model cards).
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak
H100_HBM_BPS = 3.35e12  # HBM3 bandwidth
NVLINK_BPS = 450e9  # NVLink 4, one direction (900 GB/s total)
IB_NDR_BPS = 50e9  # one 400 Gb/s InfiniBand NDR port per GPU
LLM_PARAMS = 6.74e9  # Vicuna-7B = Llama-2-7B
LLM_LAYERS, LLM_HIDDEN = 32, 4096  # 32 heads x 128, no GQA
VISION_PARAMS = 0.304e9 + 0.021e9  # CLIP ViT-L/14 + the 2-layer MLP projector
VISION_TOKENS = 577  # 336 / 14 = 24 -> 576 patches + CLS
BYTES = 2  # bf16

# Efficiency assumptions (what serving engines such as vLLM / TensorRT-LLM typically reach).
DECODE_HBM_EFF = 0.75  # of HBM bandwidth, memory-bound decode
PREFILL_MFU = 0.55  # of the bf16 peak, compute-bound prefill chunks
DECODE_MFU = 0.5  # the per-sequence matmul work inside a decode step
VISION_MFU = 0.4  # small ViT batches
LINK_EFF = 0.8  # of NVLink / InfiniBand line rate for NCCL point-to-point
SERVER_CORE_SPEEDUP = 1.5  # a server core vs this development VM's core, for host-side image decoding


def _note(value: float, how: str) -> dict[str, Any]:
    return {"value": value, "derivation": how}


def gpu_costs(cpu: dict[str, Any], interconnect: str = "ib") -> dict[str, Any]:
    weights_s = LLM_PARAMS * BYTES / (H100_HBM_BPS * DECODE_HBM_EFF)
    kv_per_token = 2 * LLM_LAYERS * LLM_HIDDEN * BYTES  # K and V, every layer
    flops_per_token = 2 * LLM_PARAMS
    vision_flops = 2 * VISION_PARAMS * VISION_TOKENS
    link = (IB_NDR_BPS if interconnect == "ib" else NVLINK_BPS) * LINK_EFF
    decode = {
        "step_s": weights_s + 0.6e-3,
        "per_seq_s": flops_per_token / (H100_BF16_FLOPS * DECODE_MFU) + 5e-6,
        "per_ctx_token_s": kv_per_token / (H100_HBM_BPS * DECODE_HBM_EFF),
        "max_num_seqs": 128, "num_blocks": 7000, "block_size": 16, "reserve_tokens": 256,
    }
    prefill = {"step_s": 4e-3, "per_token_s": flops_per_token / (H100_BF16_FLOPS * PREFILL_MFU), "per_seq_s": 0.0,
               "chunk_tokens": 2048, "max_num_seqs": 128}
    cpu_enc = cpu["encode"]
    encode = {"batch_s": 1.5e-3,
              "image_s": vision_flops / (H100_BF16_FLOPS * VISION_MFU) + 3e-3,
              "per_mpx_s": cpu_enc["per_mpx_s"] / SERVER_CORE_SPEEDUP, "max_images": 8}
    return {
        "name": f"gpu-h100-llava7b-{interconnect}",
        "kind": "derived (a model: nothing here was measured on a GPU)",
        "source": "python -m lab.sim.gpu_costs; every figure's derivation is under 'derivations'",
        "cpu": {"cores": None, "note": "every worker has its own GPU (and host cores); the coordinator one core"},
        "network": {"hop_s": 5e-5, "backend": interconnect},
        "prompts": dict(cpu["prompts"]) | {"visual_tokens_per_image": 576.0},
        "sizes": {"kv_bytes_per_token": kv_per_token, "embedding_bytes_per_visual_token": LLM_HIDDEN * BYTES},
        "encode": encode, "prefill": prefill, "decode": decode,
        "transfer": {interconnect: {"fixed_s": 5e-5, "per_byte_s": 1 / link},
                     "kv_handoff": {f"{interconnect}_per_byte_s": 1 / link, "fixed_s": 1e-4}},
        "coordinator": {k: v for k, v in cpu["coordinator"].items() if not isinstance(v, (list, dict))},
        "derivations": {
            "decode.step_s": _note(decode["step_s"], f"all {LLM_PARAMS:.3g} bf16 weights read once per step at "
                                   f"{DECODE_HBM_EFF:.0%} of {H100_HBM_BPS / 1e12:.2f} TB/s HBM3 + 0.6 ms launch/"
                                   "sampling overhead (CUDA graphs)"),
            "decode.per_seq_s": _note(decode["per_seq_s"], f"2 x {LLM_PARAMS:.3g} FLOP per token at {DECODE_MFU:.0%} "
                                      "of the 989 TFLOPS bf16 peak, + 5 us of per-sequence host work"),
            "decode.per_ctx_token_s": _note(decode["per_ctx_token_s"], f"K and V of {LLM_LAYERS} layers x "
                                            f"{LLM_HIDDEN} x 2 bytes = {kv_per_token} bytes per context token, read "
                                            f"every step at {DECODE_HBM_EFF:.0%} of HBM bandwidth"),
            "decode.num_blocks": _note(7000, "80 GB - 13.5 GB weights - ~7 GB activations/workspace = ~59 GB of KV = "
                                       "~112k tokens in 16-token blocks"),
            "decode.max_num_seqs": _note(128, "raised from MServe's CPU default of 64 (a setting, "
                                         "--max-num-seqs), as a GPU deployment would"),
            "prefill.per_token_s": _note(prefill["per_token_s"], f"2 x {LLM_PARAMS:.3g} FLOP per prompt token at "
                                         f"{PREFILL_MFU:.0%} MFU (attention over <1k tokens adds ~1 %, ignored)"),
            "prefill.step_s": _note(4e-3, "per-step overhead; a 2048-token chunk then takes ~54 ms, a 670-token "
                                    "image prompt ~21 ms, in line with published 7B TTFTs on H100"),
            "prefill.chunk_tokens": _note(2048, "--max-prefill-tokens raised from the CPU default of 512"),
            "encode.image_s": _note(encode["image_s"], f"2 x {VISION_PARAMS:.3g} params x {VISION_TOKENS} tokens "
                                    f"at {VISION_MFU:.0%} MFU (~1 ms) + 3 ms host-side resize/normalise to 336^2"),
            "encode.per_mpx_s": _note(encode["per_mpx_s"], "this machine's measured image decode cost per megapixel "
                                      f"/ {SERVER_CORE_SPEEDUP} (a server core); MServe decodes images on the "
                                      "worker's own thread, serially, so this lands on the encode worker"),
            "transfer": _note(1 / link, f"KV and embeddings worker to worker over {interconnect} "
                              f"({link / 1e9:.0f} GB/s: {LINK_EFF:.0%} of line rate), NCCL (the torch backend)"),
            "coordinator": _note(0.0, "this machine's measured coordinator CPU, unchanged"),
            "network.hop_s": _note(5e-5, "one ZeroMQ hop inside a data centre"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    from lab.sim.costs import Costs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-costs", default="cpu-small-llava", help="the measured file to take the coordinator from")
    p.add_argument("--interconnect", default="ib", choices=("ib", "nvlink"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    data = gpu_costs(Costs.load(args.cpu_costs).data, args.interconnect)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
