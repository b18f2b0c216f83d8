"""The engine in bfloat16 (the serving default on GPUs and on CPUs with native bf16) against Hugging
Face generate in bfloat16.

With `--attention exact` both sides run the same bf16 kernels: the same weights, the same SDPA over
the same keys (ours read back from a bf16 pool), so a ragged batch and a prefill -> decode hand-off of
bf16 KV blocks and embeddings reproduce HF's greedy ids bit for bit. With the default, padded
attention (and on the CPU its own bf16 kernels), the ids are HF's up to the first step where HF's own
top-2 logits are within bf16 rounding (common/exactness.py).
"""

from __future__ import annotations

import pytest
import torch

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from mserve.common.exactness import compare_greedy
from tests.helpers import hf_generate, hf_generate_top2, request_mix

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def requests(model_dir):
    """Nine prompts of ragged lengths: text-only, one image and two images of varied sizes. On
    qwen2_vl, r2's fourth token is an exact tie in HF's bf16 logits: attention over padded keys
    broke it the other way (the note under exact_setting in workers/paged_attention.py says why)."""
    builder = PromptBuilder(model_dir)
    out = {f"r{i}": builder.prepare_text(text, images) for i, (text, images) in enumerate(request_mix(9, seed=5))}
    assert len({len(p.prompt_ids) for p in out.values()}) >= 5
    return out


def bf16_engine(model_dir: str, **overrides) -> Engine:
    cfg = {"dtype": "bfloat16", "num_blocks": 512, "block_size": 16, "max_num_batched_tokens": 4096,
           "exact_attention": True, **overrides}
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


def test_default_padded_bf16_batch_matches_hf_bf16_up_to_its_ties(model_dir, requests):
    """The serving default: bfloat16 with padded attention (the CPU's bf16 prompt and decode kernels where
    built), a ragged batch of nine, each sequence HF bf16's up to HF's first top-2 tie."""
    engine = Engine(EngineConfig(model_dir, dtype="bfloat16", num_blocks=512, block_size=16,
                                 max_num_batched_tokens=4096))
    assert engine.runner.exact_attention is False  # auto is padded
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    results, compared = engine.run_until_done(), 0
    for rid, pp in requests.items():
        want, top2 = hf_generate_top2(model_dir, pp.prompt_ids, pp.images, MAX_NEW, dtype="bfloat16")
        verdict = compare_greedy(want, results[rid], top2, "bfloat16")
        assert verdict.exact, f"{rid}: {verdict.describe()}"
        compared += verdict.compared
    # Not vacuous: a tiny random model's logits are flat (near-ties are common), yet a third of all steps
    # were compared, each one a token a wrong engine would likely have changed.
    assert compared >= len(requests) * MAX_NEW // 3
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


def test_bf16_decode_attends_over_exact_key_counts():
    """A decode group of contexts of lengths that are not multiples of the vector width gives, row for
    row, the bits of an unpadded SDPA call per request (what HF's decode step runs)."""
    import torch.nn.functional as F

    from mserve.workers.paged_attention import KVCache, PagedBatch, paged_attention_forward

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 32, 16
    kv = KVCache(1, 128, kv_heads, bs, d, dtype=torch.bfloat16)
    for cache in (kv.k[0], kv.v[0]):
        cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    lengths = [37, 150, 91, 150, 13, 122, 61, 99]  # context lengths with the new token (padded: 1 row off)
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-n // bs))))
        next_block += len(tables[-1])
    batch = PagedBatch.build(kv, [(t, n - 1, 1) for t, n in zip(tables, lengths)], torch.device("cpu"), exact=True)
    query = torch.randn(1, heads, len(lengths), d, generator=g).to(torch.bfloat16)
    new_k = torch.randn(1, kv_heads, len(lengths), d, generator=g).to(torch.bfloat16)
    new_v = torch.randn(1, kv_heads, len(lengths), d, generator=g).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    out, _ = paged_attention_forward(layer, query, new_k, new_v, None, scaling=d ** -0.5, mserve_batch=batch)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        keys = kv.k[0][table].reshape(-1, kv_heads, d)[:n].transpose(0, 1)[None]
        values = kv.v[0][table].reshape(-1, kv_heads, d)[:n].transpose(0, 1)[None]
        assert torch.equal(keys[0, :, -1], new_k[0, :, i])  # the new token's K went into the pool
        want = F.scaled_dot_product_attention(query[:, :, i : i + 1], keys.contiguous(), values.contiguous(),
                                              scale=d ** -0.5, enable_gqa=True)
        assert torch.equal(out[0, i], want[0, :, 0]), f"request {i} (context {n})"


def test_attention_is_a_worker_choice_and_auto_is_padded(model_dir, requests):
    """`--attention` (WorkerSettings.attention): exact turns exact-length attention on; auto and padded
    run one SDPA call per group, every request still answered in full."""
    from mserve.workers.settings import WorkerSettings

    settings = {a: WorkerSettings(role="decode", model=model_dir, attention=a).exact_attention()
                for a in ("auto", "exact", "padded")}
    assert settings == {"auto": False, "exact": True, "padded": False}
    engine = bf16_engine(model_dir, exact_attention=settings["auto"])
    assert engine.runner.exact_attention is False
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    results = engine.run_until_done()
    assert sorted(results) == sorted(requests) and all(len(ids) == MAX_NEW for ids in results.values())
    assert bf16_engine(model_dir).runner.exact_attention is True


@pytest.mark.parametrize("supported", [True, False])
def test_bfloat16_on_a_cpu_without_bf16_matmuls_is_warned_of(supported, tiny_model_dirs, monkeypatch, caplog):
    """On an AVX2-only CPU oneDNN has no bf16 matmuls and torch's fallback ran 6x slower than float32:
    the worker says so at load, naming the fast choice; where the CPU has them, nothing is said."""
    from mserve.workers import model_runner

    monkeypatch.setattr(model_runner, "_cpu_bf16_matmuls", lambda: supported)
    with caplog.at_level("WARNING", logger=model_runner.__name__):
        Engine(EngineConfig(str(tiny_model_dirs["llava"]), num_blocks=16, block_size=16, dtype="bfloat16"))
    warned = [r.getMessage() for r in caplog.records if "without AVX-512" in r.getMessage()]
    if supported:
        assert warned == []
    else:
        assert len(warned) == 1 and "float32" in warned[0] and "fast choice" in warned[0]
