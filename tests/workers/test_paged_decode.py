"""The decode kernel that reads the paged pool in place (workers/paged_decode.py): the same attention
as gathering each request's blocks and calling SDPA, and, with it or without it, HF generate's tokens."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from mserve.common.prompt import PromptBuilder
from mserve.workers import kernels, paged_decode
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.paged_attention import _gather
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

needs_kernel = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the kernel is not built")


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernel built without -march=native: the portable C that a host without AVX-512 runs (on this
    host too, so that both builds are checked wherever the tests run)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("portable") / "paged_decode.so"
    error = kernels.compile_library(cc, ["-O3"], out)
    assert error is None, error
    return kernels.load(out)


def cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return set(flags) <= set(line.split())


@pytest.fixture(scope="module")
def avx2(tmp_path_factory):
    """The kernel built for AVX2 and FMA without AVX-512 (paged_decode_simd.h, 8 lanes): what the AVX2-only
    AMD EPYCs run, checked on every x86 host that can run it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        pytest.skip("needs an x86 CPU with AVX2 and FMA, and a C compiler")
    out = tmp_path_factory.mktemp("avx2") / "paged_decode.so"
    error = kernels.compile_library(cc, ["-O3", "-mavx2", "-mfma"], out)
    assert error is None, error
    return kernels.load(out)


@pytest.fixture(params=["native", "portable", "avx2"])
def build(request, monkeypatch):
    """Which build of the kernel `paged_decode.attend` calls."""
    if request.param != "native":
        fns = request.getfixturevalue(request.param)
        if platform.machine() in ("x86_64", "AMD64"):
            assert "prefill_bf16" not in fns  # neither has AVX-512 code in it
        monkeypatch.setattr(kernels, "_library", fns)
    return request.param


def gathered(q, k_cache, v_cache, tables, lens, scale):
    """What attention computes without the kernel: the blocks gathered, then one masked SDPA call."""
    k, v = _gather(k_cache, tables), _gather(v_cache, tables)
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]


@needs_kernel
# Two query heads per kv head summed at once (8/4/64, 12/2/72, 8/2/128), one at a time (4/4/32: no
# sharing, 14/2/80: an odd share), a head wider than the kernel's 256-wide register sums (4/2/288), and
# one that is not a multiple of 8 (6/3/36: the AVX2 build hands it to the portable code).
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 32), (12, 2, 72), (14, 2, 80), (8, 2, 128),
                                                     (4, 2, 288), (6, 3, 36)])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, head_dim, build):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    bs, num_blocks = 16, 300
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, 15, 16, 17, 250, 97, 640, 33])  # partial, whole and one-token blocks, ragged
    max_blocks = int(-(-lens.max() // bs))
    order = torch.randperm(num_blocks, generator=g)  # each request's blocks scattered over the pool
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)  # padded with block 0, as PagedBatch does
    used = 0
    for i, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        tables[i, :nb] = order[used : used + nb]
        used += nb
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 3  # peaked rows: softmax's max matters
    scale = head_dim ** -0.5
    out = paged_decode.attend(q, k_cache, v_cache, tables, lens, int(lens.max()), scale)
    torch.testing.assert_close(out, gathered(q, k_cache, v_cache, tables, lens, scale), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (12, 2, 72)])
def test_kernel_reads_a_bf16_pool(heads, kv_heads, head_dim, build):
    """A bfloat16 pool (`--dtype bfloat16 --attention padded`): each row widened to float32 as it is
    read, so the result is float32 attention over the pool's very values, rounded once to bf16."""
    g = torch.Generator().manual_seed(7)
    bs, lens = 16, torch.tensor([1, 16, 17, 250, 640, 33])
    max_blocks = int(-(-lens.max() // bs))
    tables = torch.arange(len(lens) * max_blocks).view(len(lens), max_blocks).flip(1).contiguous()
    k_cache = torch.randn(tables.numel(), bs, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(tables.numel(), bs, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 3).to(torch.bfloat16)
    scale = head_dim ** -0.5
    out = paged_decode.attend(q, k_cache, v_cache, tables, lens, int(lens.max()), scale)
    assert out.dtype == torch.bfloat16
    want = gathered(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), want, atol=1e-5, rtol=2 ** -8)  # one bf16 rounding apart at most
    assert paged_decode.usable(q.transpose(0, 1), k_cache)
    assert not paged_decode.usable(q.transpose(0, 1).float(), k_cache)  # the query in the pool's dtype only


@needs_kernel
def test_a_length_past_the_table_is_refused():
    k = torch.zeros(4, 16, 1, 16)
    with pytest.raises(ValueError, match="context length"):
        paged_decode.attend(torch.zeros(1, 1, 16), k, k, torch.zeros(1, 1, dtype=torch.long),
                            torch.tensor([17]), 17, 1.0)


@pytest.mark.parametrize("kernel", ["kernel", "portable", "avx2", "gather"])
def test_engine_decodes_hf_tokens_with_and_without_the_kernel(kernel, tiny_model_dirs, monkeypatch, request):
    """A ragged batch (text-only and image prompts of different lengths) decoded together, by the kernel,
    by its portable and AVX2 builds (hosts without AVX-512: each runs here too, where the CPU can) and by
    the gather it replaces (the path of a host without a compiler), against HF generate."""
    if kernel != "gather" and kernels.library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    if kernel == "gather":
        monkeypatch.setattr(kernels, "_library", None)
    if kernel in ("portable", "avx2"):
        monkeypatch.setattr(kernels, "_library", request.getfixturevalue(kernel))
    calls = []
    attend = paged_decode.attend
    monkeypatch.setattr(paged_decode, "attend", lambda *a: calls.append(a[0].shape[0]) or attend(*a))
    model_dir = str(tiny_model_dirs["llava"])
    builder = PromptBuilder(model_dir)
    requests = {}
    for i in range(5):
        images = [make_image(90 + 30 * i, 70 + 20 * i, seed=i)] if i % 2 else []
        requests[f"r{i}"] = builder.prepare_text(PROMPTS[i % len(PROMPTS)], images)
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=256, block_size=16))
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=12))
    results = engine.run_until_done()
    for rid, pp in requests.items():
        assert results[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, 12), rid
    if kernel != "gather":  # every decode step went through it, the first with all five requests
        assert len(calls) >= 11 * engine.runner.model.config.text_config.num_hidden_layers and max(calls) == 5
    else:
        assert not calls


@needs_kernel
def test_without_a_compiler_a_cached_kernel_still_loads(tmp_path, monkeypatch):
    """No cc on PATH: an empty cache gives no kernel (attention gathers), and a cache holding the
    library built on a host like this one (a mounted folder, as deploy/README.md says) gives it."""
    built = kernels.library_path()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("MSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_library", kernels._UNSET)
    assert kernels.library() is None
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / built.name).write_bytes(built.read_bytes())
    monkeypatch.setattr(kernels, "_library", kernels._UNSET)
    assert kernels.library() is not None
