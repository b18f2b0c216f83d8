"""Cached probe verdicts: a restart (or a second worker of the same checkpoint) does not pay the probe again.

A verdict is keyed by the checkpoint's content (every file's bytes), the dtype and mserve's version:
other weights, another dtype or another engine build are proven again. The file is small JSON under
$MSERVE_CACHE_DIR/verdicts (default ~/.cache/mserve/verdicts). Workers starting together take a file
lock per key, so one probes and the others read its verdict.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

log = logging.getLogger("mserve.probe")


def mserve_version() -> str:
    try:
        return version("mserve")
    except PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    root = os.environ.get("MSERVE_CACHE_DIR") or Path.home() / ".cache" / "mserve"
    return Path(root) / "verdicts"


def checkpoint_hash(model_dir: str | os.PathLike) -> str:
    """blake2b over every file's relative path and bytes, in sorted order (hidden files left out)."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        digest.update(rel.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def verdict_key(model_dir: str | os.PathLike, dtype: str) -> str:
    return f"{checkpoint_hash(model_dir)}-{dtype}-{mserve_version()}"


def cached_verdict(model_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None,
                   refresh: bool = False) -> tuple[dict[str, Any], bool]:
    """(the verdict as JSON, whether it came from the cache), probing when none is cached."""
    from mserve.workers.model_loading import resolve_dtype
    from mserve.workers.probe import verify

    name = str(resolve_dtype(device, dtype, model_dir)).removeprefix("torch.")
    path = cache_dir() / f"{verdict_key(model_dir, name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker starting beside us waits, then reads our verdict
        if path.is_file() and not refresh:
            log.info("probe verdict of %s (%s) read from %s", model_dir, name, path)
            return json.loads(path.read_text()), True
        start = time.perf_counter()
        verdict = verify(str(model_dir), device, dtype).to_json()
        _release_probe_memory(device)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(verdict, indent=1))
        tmp.replace(path)
        log.info("probe of %s (%s): %s in %.1f s, verdict in %s", model_dir, name,
                 "served" if verdict["served"] else "refused", time.perf_counter() - start, path)
        return verdict, False


def _release_probe_memory(device: str) -> None:
    """The probe's model and engines are garbage now: free them before the worker loads its own copy, so
    the two are never resident together."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def require_verified(model_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None) -> dict | None:
    """For a family without tests here: its cached (or fresh) verdict, raising UnsupportedModelError
    with the probe's one-line reason when refused. None for a tested family (no probe)."""
    from mserve.common.model import load_family
    from mserve.common.processor import UnsupportedModelError

    family = load_family(model_dir)  # a trait the engine lacks is refused here, before any weight loads
    if family.tested:
        return None
    verdict, _ = cached_verdict(model_dir, device, dtype)
    if not verdict["served"]:
        raise UnsupportedModelError(f"model_type {family.model_type!r} failed the load-time exactness probe: "
                                    f"{verdict['reason']}")
    return verdict
