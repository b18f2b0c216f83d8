"""A real Prometheus (Debian's `prometheus` package) for a test: 127.0.0.1, a free port, a temp config
scraping the given /metrics endpoints every second, its data in a temp folder, stopped after."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from mserve.common.sockets import free_port

PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    def __init__(self, folder: Path, targets: list[str], scrape_every_s: int = 1) -> None:
        assert PROMETHEUS, "Debian's prometheus is not installed (apt-get install prometheus)"
        assert all(t.startswith("127.0.0.1:") for t in targets), targets
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{scrape_every_s}s", "evaluation_interval": f"{scrape_every_s}s"},
            "scrape_configs": [{"job_name": "mserve", "static_configs": [{"targets": targets}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = folder / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                      f"--web.listen-address={self.url[len('http://'):]}",
                                      "--storage.tsdb.retention.time=1h"],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (/api/v1/query)."""
        return self.get("/api/v1/query", query=expr)["result"]

    def targets_up(self) -> bool:
        """Every target scraped at least once and healthy."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
        try:
            active = self.get("/api/v1/targets")["activeTargets"]
        except OSError:
            return False  # not listening yet
        return bool(active) and all(t["health"] == "up" for t in active)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

