"""The C kernels (workers/csrc): built once per host with its `cc`, cached, loaded through ctypes.

One shared library holds them all: decode attention over the paged pool (paged_decode.c, used by
workers/paged_decode.py), prompt attention (paged_prefill.c, workers/paged_prefill.py) and the bf16
elementwise ops (fused_ops.c, workers/fused_ops.py), with the AVX-512 helpers they share (simd.h).
The attention kernels are built everywhere (AVX-512 where the host has it; decode attention's vector
build, paged_decode_simd.h, 8 lanes wide in AVX2 where that is the best it has; portable C elsewhere);
the bf16-only ones only where the CPU has AVX512_BF16.

It is plain C (no torch headers), compiled into the user's cache the first time a worker needs it
(about a second) under a name made of the sources and the CPU's flags, so a cache folder mounted
into a host without a compiler still serves (deploy/README.md). ctypes releases the GIL around
each call. Where no compiler is found, the build fails, or `MSERVE_DECODE_KERNEL=off`, `library()`
is None and every user falls back to torch's ops: the tokens are the same either way.

`switched_off(name)` is the one reading of the `MSERVE_*=off` switches these fast paths share.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_decode.c", CSRC / "paged_prefill.c", CSRC / "fused_ops.c")
HEADERS = (CSRC / "simd.h", CSRC / "amx.h", CSRC / "paged_decode_simd.h")
_FLAGS = (["-O3", "-march=native"], ["-O3"])  # the second where the compiler does not know the host
_OFF = ("off", "0", "false", "no")
_UNSET = object()
_library: object = _UNSET


def switched_off(name: str) -> bool:
    """Whether the environment turns the fast path `name` (MSERVE_DECODE_KERNEL, ...) off."""
    return os.environ.get(name, "auto").strip().lower() in _OFF


def cache_dir() -> Path:
    root = os.environ.get("MSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mserve", "kernels")
    return Path(root)


def host_key() -> str:
    """What a -march=native build depends on besides its source: the machine and its CPU's flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    return hashlib.sha256((platform.machine() + flags).encode() + sources).hexdigest()[:16]


def library_path() -> Path:
    """Where this host's build lives in the cache (it may not exist yet)."""
    return cache_dir() / f"paged_decode-{host_key()}.so"


def compile_library(cc: str, flags: list[str], out: Path) -> str | None:
    """Build SOURCES into the shared library `out` with `flags`; None on success, else the compiler's
    complaint. Built under a temporary name and renamed: workers starting together never load a
    half-written file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    res = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES), "-lm"],
                         capture_output=True, text=True)
    if res.returncode == 0:
        os.replace(tmp, out)
        return None
    os.unlink(tmp)
    return res.stderr.strip()[-500:]


def _build() -> Path | None:
    """The shared library: already in the cache (built here before, or mounted in), or built now."""
    out = library_path()
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("C kernels: no C compiler (cc, gcc) to build %s, so torch's ops run instead (the same "
                 "tokens; decode attention gathers each request's KV blocks first, slower at long contexts)",
                 out.name)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAGS:
        error = compile_library(cc, flags, out)
        if error is None:
            log.info("C kernels: built %s (%s)", out, " ".join(flags))
            return out
        errors.append(error)
    log.warning("C kernels: %s could not build %s, so torch's ops run instead: %s", cc, out.name, errors[-1])
    return None


def _bind(lib: ctypes.CDLL, name: str, restype, argtypes: list) -> object:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def load(path: Path) -> dict:
    """The C functions of a built library: decode attention by pool dtype (torch.float32,
    torch.bfloat16), and where the CPU has AVX512_BF16 the prompt kernel ("prefill_bf16",
    "prefill_scratch_words"; "prefill_amx", whether its products run on AMX tiles here, and
    "prefill_use_amx", which turns them off for a comparison) and the elementwise ops ("rms_norm_bf16", "silu_mul_bf16", "rope_bf16");
    everywhere the float32 rotary embedding ("rope_f32")."""
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    decode_args = [p] * 7 + [i64] * 7 + [ctypes.c_float]
    fns = {torch.float32: _bind(lib, "paged_decode_f32", ctypes.c_int, decode_args),
           torch.bfloat16: _bind(lib, "paged_decode_bf16", ctypes.c_int, decode_args)}
    if hasattr(lib, "paged_prefill_bf16"):
        fns["prefill_bf16"] = _bind(lib, "paged_prefill_bf16", ctypes.c_int, [p] * 7 + [i64] * 9 + [ctypes.c_float])
        fns["prefill_scratch_words"] = _bind(lib, "paged_prefill_scratch_words", i64, [i64] * 4)
        fns["prefill_amx"] = _bind(lib, "paged_prefill_amx", ctypes.c_int, [])
        fns["prefill_use_amx"] = _bind(lib, "paged_prefill_use_amx", None, [i64])
    if hasattr(lib, "rms_norm_bf16"):
        fns["rms_norm_bf16"] = _bind(lib, "rms_norm_bf16", ctypes.c_int, [p] * 3 + [i64] * 4 + [ctypes.c_float])
        fns["silu_mul_bf16"] = _bind(lib, "silu_mul_bf16", None, [p] * 3 + [i64] * 5)
    if hasattr(lib, "rope_bf16"):
        fns["rope_bf16"] = _bind(lib, "rope_bf16", None, [p] * 4 + [i64] * 12)
    if hasattr(lib, "rope_f32"):
        fns["rope_f32"] = _bind(lib, "rope_f32", None, [p] * 4 + [i64] * 12)
    return fns


def library() -> dict | None:
    """This host's loaded C functions (see `load`), built on first call; None where there is no
    compiler and no cached build, the build failed, or MSERVE_DECODE_KERNEL=off."""
    global _library
    if _library is _UNSET:
        _library = None
        if not switched_off("MSERVE_DECODE_KERNEL"):
            try:
                path = _build()
                if path is not None:
                    _library = load(path)
                    log.info("C kernels: loaded %s", path)
            except OSError as exc:
                log.warning("C kernels: could not load them (%s); torch's ops run instead", exc)
    return _library
