"""CUDA IPC for the ``torch`` backend when sender and receiver share one GPU.

NCCL refuses two ranks of one communicator on the same GPU, so a cluster on one GPU (encode,
prefill and decode as three processes on it) cannot move device tensors over a pair group. When
the receiver's GPU is the sender's own (same host and IPC namespace, same device UUID), the sender
instead hands out a CUDA IPC handle to its flat buffer and the receiver copies it into its own
memory, device to device. The sender keeps the buffer until the receiver's ack, as for every
backend.

The handle is the one ``torch.multiprocessing`` shares CUDA tensors with (``reduce_tensor`` /
``rebuild_cuda_tensor``), sent as plain ints and bytes, never pickled.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gpu_identity", "share", "open_copy"]


def gpu_identity(device: str | torch.device, host_id: str) -> str | None:
    """``host_id/device-uuid`` of a CUDA device, or None (not CUDA, or no UUID to compare)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else f"{host_id}/{uuid}"


def share(flat: torch.Tensor) -> list[Any]:
    """A wire-safe handle to the CUDA uint8 buffer ``flat`` (kept alive by the caller)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    # args: tensor class, size, stride, tensor offset, storage class, dtype, device, handle,
    # storage bytes, storage offset bytes, requires_grad, ref counter handle and offset, event
    # handle, event sync required. The classes, dtype and shape are implied (a flat uint8 buffer).
    (_, size, stride, tensor_offset, _, dtype, _, handle, storage_bytes, storage_offset,
     _, ref_handle, ref_offset, event_handle, event_sync) = args
    if dtype != torch.uint8 or tuple(stride) != (1,):
        raise ValueError("share() takes a flat contiguous uint8 buffer")
    return [int(size[0]), int(tensor_offset), bytes(handle), int(storage_bytes), int(storage_offset),
            bytes(ref_handle), int(ref_offset), None if event_handle is None else bytes(event_handle),
            bool(event_sync)]


def open_copy(parts: list[Any], nbytes: int, device: str) -> torch.Tensor:
    """Open a ``share`` handle on this process's ``device`` and return a copy in its own memory;
    the sender may free its buffer once this returns."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(parts) != 9:
        raise ValueError(f"a CUDA IPC handle has 9 parts, got {len(parts)}")
    (size, tensor_offset, handle, storage_bytes, storage_offset, ref_handle, ref_offset,
     event_handle, event_sync) = parts
    if size != nbytes:
        raise ValueError(f"the shared buffer holds {size} B, the descriptor says {nbytes}")
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        shared = rebuild_cuda_tensor(
            torch.Tensor, (size,), (1,), tensor_offset, torch.storage.TypedStorage, torch.uint8, index,
            handle, storage_bytes, storage_offset, False, ref_handle, ref_offset, event_handle, event_sync)
        out = shared.clone()
        # The copy must be done before the sender hears the ack and reuses the memory.
        torch.cuda.current_stream(index).synchronize()
    del shared
    return out
