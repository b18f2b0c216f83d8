"""A worker's pulse: heartbeats and load reports from a thread of their own, whatever the engine is doing.

An engine step can take seconds at saturation (a long prompt chunk, a big encode batch); liveness
must not wait for it. The pulse thread calls `beat` every `period_s`; the worker guards the one
coordinator socket both threads use with a lock (ZeroMQ sockets are not thread-safe), and the
beat only reads the engine's counters, never changes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mserve.common.cpu_placement import on_io_cores

log = logging.getLogger("mserve.worker")


class Pulse:
    def __init__(self, period_s: float, beat: Callable[[], None]) -> None:
        self.period_s = period_s
        self._beat = beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mserve-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        on_io_cores()
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
            except Exception:  # a failed beat is retried next period; the pulse must not die
                log.exception("heartbeat failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
