"""A program a test runs beside the cluster (Chromium, Prometheus): started with its output in a log file,
stopped on close (terminate, then kill after 10 s), usable as a context manager."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


class LoggedProcess:
    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
