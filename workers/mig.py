"""NVIDIA MIG profiles (the memory and compute slices of each instance size) and selecting a MIG instance
for a worker: what `workers/sizing.py` plans a GPU share against (docs/gpu-partitioning.md)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from mserve.workers.sizing import GIB, SizingError


@dataclass(frozen=True)
class MigProfile:
    gpu: str
    name: str  # as nvidia-smi and the device plugin spell it: 1g.10gb
    memory_slices: int  # of 8
    compute_slices: int  # of 7 (SM slices)
    max_instances: int  # of this profile on one GPU
    board_memory_gib: int

    @property
    def memory_bytes(self) -> int:
        """Nominal: slices × board / 8. A running instance reports a little less; a worker on a MIG device
        sizes against what the device reports, this is for planning."""
        return self.board_memory_gib * GIB * self.memory_slices // 8

    @property
    def resource(self) -> str:
        """The Kubernetes extended resource under the NVIDIA device plugin's `mixed` MIG strategy."""
        return f"nvidia.com/mig-{self.name}"


def _profiles(gpu: str, board_gib: int, rows: list[tuple[str, int, int, int]]) -> tuple[MigProfile, ...]:
    return tuple(MigProfile(gpu, name, mem, sm, n, board_gib) for name, mem, sm, n in rows)


_A100_40 = [("1g.5gb", 1, 1, 7), ("1g.5gb+me", 1, 1, 1), ("1g.10gb", 2, 1, 4), ("2g.10gb", 2, 2, 3),
            ("3g.20gb", 4, 3, 2), ("4g.20gb", 4, 4, 1), ("7g.40gb", 8, 7, 1)]
_80GB = [("1g.10gb", 1, 1, 7), ("1g.10gb+me", 1, 1, 1), ("1g.20gb", 2, 1, 4), ("2g.20gb", 2, 2, 3),
         ("3g.40gb", 4, 3, 2), ("4g.40gb", 4, 4, 1), ("7g.80gb", 8, 7, 1)]
MIG_PROFILES: dict[str, tuple[MigProfile, ...]] = {
    "A100-40GB": _profiles("A100-40GB", 40, _A100_40),
    "A100-80GB": _profiles("A100-80GB", 80, _80GB),
    "H100-80GB": _profiles("H100-80GB", 80, _80GB),
}


def mig_profile(spec: str) -> MigProfile:
    """'A100-80GB:3g.40gb' (the profile may also be spelt as its resource, nvidia.com/mig-3g.40gb) -> its row."""
    gpu, sep, name = spec.partition(":")
    gpu, name = gpu.strip().upper(), name.strip().lower().removeprefix("nvidia.com/mig-")
    if not sep or gpu not in MIG_PROFILES:
        raise SizingError(f"MIG profile {spec!r}: name the GPU and the profile, e.g. 'A100-80GB:1g.10gb'; "
                          f"GPUs: {', '.join(MIG_PROFILES)}")
    for p in MIG_PROFILES[gpu]:
        if p.name == name:
            return p
    raise SizingError(f"{gpu} has no MIG profile {name!r}; it has {', '.join(p.name for p in MIG_PROFILES[gpu])}")



def select_mig_device(mig_device: str, device: str) -> None:
    """CUDA_VISIBLE_DEVICES = the MIG instance's UUID; must happen before CUDA starts in this process."""
    if not device.startswith("cuda"):
        raise SizingError(f"mig_device={mig_device!r} needs device=cuda (device is {device!r})")
    if not mig_device.startswith("MIG-"):
        raise SizingError(f"mig_device={mig_device!r}: give the MIG instance's UUID (MIG-...) as `nvidia-smi -L` "
                          f"lists it")
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if current != mig_device and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise SizingError(f"mig_device={mig_device!r} was set after CUDA started (CUDA_VISIBLE_DEVICES={current!r})")
    os.environ["CUDA_VISIBLE_DEVICES"] = mig_device
