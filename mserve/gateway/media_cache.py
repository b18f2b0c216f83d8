"""The gateway's HTTP cache for fetched media: a hot URL is not fetched again while fresh
(``Cache-Control: max-age``) and is revalidated (``If-None-Match`` / ``If-Modified-Since``, a 304 keeps the
bytes) once stale. Bounded in bytes, least recently used out first; thread-safe (fetches run in threads).

Only bytes that passed every rule are stored (gateway/media_fetch.py), keyed by the URL requested at
that hop. ``no-store`` is never stored; ``no-cache`` (or no max-age) is stored only with a validator
and revalidated on every use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CachedMedia", "MediaCache", "max_age_of"]


@dataclass
class CachedMedia:
    data: bytes
    fresh_until: float  # monotonic seconds; before it the bytes are served without asking the origin
    etag: str | None
    last_modified: str | None

    def validators(self) -> dict[str, str]:
        headers = {}
        if self.etag:
            headers["If-None-Match"] = self.etag
        if self.last_modified:
            headers["If-Modified-Since"] = self.last_modified
        return headers


def max_age_of(cache_control: str | None) -> float | None:
    """Seconds the response may be reused without revalidation; None: do not store it at all."""
    max_age = 0.0
    for item in (cache_control or "").lower().split(","):
        name, _, value = item.strip().partition("=")
        if name in ("no-store", "private"):
            return None
        if name == "no-cache":
            return 0.0
        if name in ("max-age", "s-maxage"):
            try:
                max_age = max(max_age, float(value.strip().strip('"')))
            except ValueError:
                return 0.0
    return max_age


class MediaCache:
    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.clock = max_bytes, clock
        self._items: OrderedDict[str, CachedMedia] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.revalidated = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, url: str) -> CachedMedia | None:
        with self._lock:
            item = self._items.get(url)
            if item is not None:
                self._items.move_to_end(url)
            return item

    def is_fresh(self, item: CachedMedia) -> bool:
        return self.clock() < item.fresh_until

    def put(self, url: str, data: bytes, cache_control: str | None, etag: str | None,
            last_modified: str | None) -> None:
        max_age = max_age_of(cache_control)
        if max_age is None or len(data) > self.max_bytes or (max_age <= 0 and not (etag or last_modified)):
            return  # nothing to reuse it by
        item = CachedMedia(data, self.clock() + max_age, etag, last_modified)
        with self._lock:
            old = self._items.pop(url, None)
            if old is not None:
                self._bytes -= len(old.data)
            self._items[url] = item
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                _, out = self._items.popitem(last=False)
                self._bytes -= len(out.data)

    def refresh(self, url: str, item: CachedMedia, cache_control: str | None) -> None:
        """A 304: the stored bytes are current again for the new max-age."""
        max_age = max_age_of(cache_control)
        with self._lock:
            if max_age is None:
                if self._items.pop(url, None) is item:
                    self._bytes -= len(item.data)
                return
            item.fresh_until = self.clock() + max_age
