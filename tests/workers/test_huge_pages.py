"""The KV pool's tensors on transparent huge pages: zeroed like torch.zeros, advised where the host can."""

from __future__ import annotations

import re

import pytest
import torch

from mserve.workers import huge_pages
from mserve.workers.paged_attention import KVCache


@pytest.fixture(autouse=True)
def fresh_setting(monkeypatch):
    monkeypatch.delenv("MSERVE_HUGE_PAGES", raising=False)
    huge_pages._madvise.cache_clear()
    yield
    huge_pages._madvise.cache_clear()


def advised_bytes(t: torch.Tensor) -> int:
    """The bytes of `t`'s memory in mappings the kernel marks MADV_HUGEPAGE ('hg' in smaps' VmFlags)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, span = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                span = (max(lo, start), min(hi, end)) if lo < end and hi > start else None
            elif span and line.startswith("VmFlags:") and " hg" in line:
                total += span[1] - span[0]
    return total


def test_zeros_are_zeros_of_the_shape_and_dtype():
    t = huge_pages.zeros((300, 16, 4, 64), torch.bfloat16)
    assert t.shape == (300, 16, 4, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    tiny = huge_pages.zeros((3, 5), torch.float32)  # under 2 MiB: nothing to advise, still zeros
    assert tiny.shape == (3, 5) and not tiny.any()


@pytest.mark.skipif(huge_pages.thp_mode() not in ("madvise", "always"), reason="this host's kernel has THP off")
def test_a_pool_sized_tensor_is_advised_over_its_aligned_middle():
    t = huge_pages.zeros((2048, 16, 4, 64), torch.bfloat16)  # 16 MiB
    size = t.numel() * t.element_size()
    assert size - 2 * huge_pages.HUGE <= advised_bytes(t) <= size


@pytest.mark.skipif(huge_pages.thp_mode() not in ("madvise", "always"), reason="this host's kernel has THP off")
def test_the_kv_pool_is_advised():
    cache = KVCache(num_layers=2, num_blocks=1024, kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16)
    assert all(advised_bytes(t) >= 4 << 20 for t in cache.k + cache.v)  # 8 MiB each
    assert not cache.k[0].any()


def test_switched_off_leaves_4k_pages(monkeypatch):
    monkeypatch.setenv("MSERVE_HUGE_PAGES", "off")
    t = huge_pages.zeros((2048, 16, 4, 64), torch.bfloat16)
    # (not read back from smaps: the allocator may hand out memory an earlier tensor had advised)
    assert huge_pages._madvise() is None and huge_pages.advise(t) == 0 and not t.any()


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", setting)
    assert huge_pages.thp_mode() == "madvise"
    setting.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode() == "never"
    assert huge_pages.advise(torch.empty(4 << 20, dtype=torch.uint8)) == 0
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "absent")
    assert huge_pages.thp_mode() is None
