"""The KV pool's tensors on transparent huge pages (Linux, CPU).

A decode step reads every running request's K/V blocks where the pool holds them. After the pool has
turned over, a request's blocks lie all over it, and on 4 KiB pages every 8 KiB block of the peer's
`small` llava is two more TLB entries. On the AMD EPYC host of 2026-12-05 the decode kernel (16
requests of 640-700 tokens, 8 layers, bf16, blocks scattered over the pool) took 6.0-6.5 ms a step on
4 KiB pages and 5.4-5.8 on 2 MiB pages; with each request's blocks in order, no difference showed
(`lab.decode_kernel --blocks scattered --huge-pages off|on`; bench/lab/NOTEBOOK.md, "bf16 on the CPU").

Most hosts set THP to `madvise`: only regions a process asks for get huge pages. `zeros` allocates
the tensor, asks for huge pages over the 2 MiB-aligned part of it with madvise(MADV_HUGEPAGE) before
anything touches it, then zeroes it, which faults it in. Where the kernel says no (THP `never`, not
Linux, a device tensor) it is an ordinary torch.zeros. `MSERVE_HUGE_PAGES=off` keeps 4 KiB pages.

The price is at start: faulting in 2 MiB pages took 1.26 s a GiB the first time on that host (a VM)
and 0.29 s once the host had handed out huge pages before, against 0.22 s for 4 KiB pages: a
worker's default pool of 2,048 blocks for the `small` llava (256 MiB) starts up to 0.3 s later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from pathlib import Path

import torch

from mserve.workers import kernels

log = logging.getLogger(__name__)

HUGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) PMD size
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP setting (`always`, `madvise` or `never`), None where there is none to read."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w for w in text.split() if w.startswith("[")]
    return chosen[0].strip("[]") if chosen else None


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux") or kernels.switched_off("MSERVE_HUGE_PAGES"):
        return None
    if thp_mode() in (None, "never"):
        log.info("KV pool on 4 KiB pages: transparent huge pages are off on this host (%s)", THP_MODE)
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> int:
    """Ask for huge pages over the 2 MiB-aligned part of `t`'s memory; the bytes asked for (0 where
    none could be: too small, not on the CPU, THP off, or madvise refused)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi <= lo:
        return 0
    if fn(lo, hi - lo, MADV_HUGEPAGE) != 0:
        log.info("KV pool on 4 KiB pages: madvise(MADV_HUGEPAGE) failed (errno %d)", ctypes.get_errno())
        return 0
    return hi - lo


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """torch.zeros(shape), on huge pages where the host gives them (see the module's text)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise(t)
    return t.zero_()
