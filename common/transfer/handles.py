"""The two handles the transfer engine gives out: a receiver's zero-copy ``FetchedView`` and a
sender's ``Allocation`` (tensors written in place, then published without a staging copy)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FetchedView", "Allocation"]


class FetchedView:
    """A fetched transfer whose tensors may be views of the sender's shared memory.

    The tensors are valid until ``release()``. Releasing acks the sender, which may then reuse
    that memory for a later transfer: copy whatever must outlive the view before releasing, and
    do not touch the tensors afterwards. Idempotent; also the context manager's exit::

        with engine.fetch_view(descriptor) as tensors:
            pool.import_blocks(ids, tensors["kv"])  # copies; the view is released after this

    For backends whose bytes already arrived in this process's own memory (tcp, torch, or any
    fetch onto a non-CPU device) the tensors stay valid after release, which only drops them.
    """

    def __init__(
        self, transfer_id: str, tensors: dict[str, torch.Tensor], on_release: Callable[[], None] | None
    ) -> None:
        self.transfer_id = transfer_id
        self.tensors = tensors
        self.zero_copy = on_release is not None  # True: the tensors alias the sender's memory
        self._on_release = on_release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            callback, self._on_release = self._on_release, None
            self.tensors = {}
        if callback is not None:
            callback()

    def __enter__(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def __exit__(self, *exc: object) -> None:
        self.release()


class Allocation:
    """Writable tensors laid out the way a transfer publishes them (for shm: views into a
    pooled segment). Fill them, then ``TransferEngine.publish_allocated``; or ``free()`` to
    give the memory back unpublished. After publishing, the engine owns the memory: do not
    write to the tensors any more."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], backend: str, storage: Any, layout: tuple[list, int]
    ) -> None:
        self.tensors = tensors
        self.backend = backend
        self.storage = storage
        self.layout = layout
        self.published = False

    def free(self) -> None:
        """Return the memory of an allocation that will not be published (idempotent)."""
        if not self.published:
            self.published = True
            self.tensors = {}
            self.storage.free(recycle=True)  # no receiver ever saw it: safe to reuse

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()  # a no-op once published
