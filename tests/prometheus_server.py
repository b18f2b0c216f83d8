"""A real Prometheus (Debian's `prometheus` package) for a test: 127.0.0.1, a free port, a temp config
scraping the given /metrics endpoints every second, its data in a temp folder, stopped after."""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from mserve.common.sockets import free_port
from tests.logged_process import LoggedProcess

PROMETHEUS = shutil.which("prometheus")


class Prometheus(LoggedProcess):
    def __init__(self, folder: Path, targets: list[str], scrape_every_s: int = 1) -> None:
        assert PROMETHEUS, "Debian's prometheus is not installed (apt-get install prometheus)"
        assert all(t.startswith("127.0.0.1:") for t in targets), targets
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{scrape_every_s}s", "evaluation_interval": f"{scrape_every_s}s"},
            "scrape_configs": [{"job_name": "mserve", "static_configs": [{"targets": targets}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        super().__init__([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                          f"--web.listen-address={self.url[len('http://'):]}", "--storage.tsdb.retention.time=1h"],
                         folder / "prometheus.log")

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


