"""Decoding the next encode batch's images on threads while the current batch runs the vision tower.

The encode role (workers/roles/encode.py) asks, before each vision forward, that the images of the
batch after it start decoding (`start`); when their turn comes it `take`s them, waiting for a decode
still running or decoding on the spot one never started. PIL releases the GIL while it decodes, so
this overlaps with the forward (bench/lab/NOTEBOOK.md, "Worker loop IO": image decoding beside the
vision forward). Only what the current and the next batch need is kept (`keep`): decoded pixels never
pile up behind a queue.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

from mserve.common.cpu_placement import on_io_cores

DECODE_THREADS = 2


class Visual(Protocol):
    hash: str


class ImagePrefetch:
    def __init__(self, decode: Callable[[Any], Any], threads: int = DECODE_THREADS) -> None:
        self._decode = decode  # one image reference -> what the vision forward takes (PIL, or frames)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="image-decode", initializer=on_io_cores)
        self._started: dict[str, Future] = {}  # by image hash

    def start(self, images: list[Visual]) -> None:
        """Decode these on the threads (each hash once)."""
        for im in images:
            if im.hash not in self._started:
                self._started[im.hash] = self._pool.submit(self._decode, im)

    def take(self, im: Visual) -> Any:
        """The decoded image: from its prefetch (its error raised here, as a decode here would), or now."""
        fut = self._started.pop(im.hash, None)
        return fut.result() if fut is not None else self._decode(im)

    def keep(self, images: list[Visual]) -> None:
        """Forget prefetches of any other image (a cancelled request's, or one a newer batch displaced)."""
        wanted = {im.hash for im in images}
        for h in [h for h in self._started if h not in wanted]:
            self._started.pop(h).cancel()  # a decode already running finishes and is dropped

    def __len__(self) -> int:
        return len(self._started)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
