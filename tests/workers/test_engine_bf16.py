"""The engine in bfloat16 (the CUDA default) gives exactly the tokens of Hugging Face generate in bfloat16.

On the CPU both sides run the same bf16 kernels: the same weights, the same SDPA over the same keys
(ours read back from a bf16 pool), so a ragged batch and a prefill -> decode hand-off of bf16 KV
blocks and embeddings must reproduce HF's greedy ids exactly.
"""

from __future__ import annotations

import pytest
import torch

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def requests(model_dir):
    """Nine prompts of ragged lengths: text-only, one image and two images of varied sizes."""
    builder = PromptBuilder(model_dir)
    out = {}
    for i in range(9):
        images = [make_image(120 + 40 * i + 37 * k, 90 + 25 * i + 23 * k, seed=100 * i + k) for k in range(i % 3)]
        out[f"r{i}"] = builder.prepare_text(PROMPTS[i % len(PROMPTS)], images)
    assert len({len(p.prompt_ids) for p in out.values()}) >= 5
    return out


def bf16_engine(model_dir: str, **overrides) -> Engine:
    cfg = {"dtype": "bfloat16", "num_blocks": 512, "block_size": 16, "max_num_batched_tokens": 4096, **overrides}
    return Engine(EngineConfig(model_dir, **cfg))


def hf_bf16(model_dir, pp) -> list[int]:
    return hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW, dtype="bfloat16")


def test_ragged_batch_in_bf16_matches_hf_bf16(model_dir, requests):
    engine = bf16_engine(model_dir)
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.kv.dtype == torch.bfloat16
    seqs = [engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
            for rid, pp in requests.items()]
    assert all(e.dtype == torch.bfloat16 for s in seqs for e in s.image_embeds)
    widest, results = 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert widest == len(requests)  # one forward carried every request
    for rid, pp in requests.items():
        assert results[rid] == hf_bf16(model_dir, pp), rid
    engine.pool.check_integrity()


def test_bf16_kv_and_embeddings_hand_off_between_engines(model_dir, requests):
    """Prefill in one bf16 engine, export its KV blocks, M-RoPE positions and embeddings into
    freshly allocated buffers (as the transfer engine's are), decode in another: HF bf16's tokens."""
    chosen = {rid: requests[rid] for rid in ("r1", "r2", "r4")}  # one and two images
    prefill, decode = bf16_engine(model_dir), bf16_engine(model_dir, num_blocks=300)
    for rid, pp in chosen.items():
        prefill.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW),
                            prefill_only=True)
    first = {o.request_id: o.new_token_ids[0] for o in prefill_outputs(prefill)}
    specs = []

    def alloc(spec):
        specs.append(spec)
        return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}

    for rid in chosen:
        decode.import_kv(prefill.export_kv(rid, alloc=alloc))
    assert specs and all(spec["kv"][1] == torch.bfloat16 for spec in specs)
    assert all(dtype == torch.bfloat16 for spec in specs for name, (_, dtype) in spec.items() if name.startswith("emb"))
    results = decode.run_until_done()
    for rid, pp in chosen.items():
        assert [first[rid]] + results[rid] == hf_bf16(model_dir, pp), rid
    assert prefill.pool.num_used_blocks == 0


def prefill_outputs(engine: Engine):
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert all(o.finish_reason == "prefilled" for o in outs)
    return outs
