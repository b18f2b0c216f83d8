"""Starting and stopping what `mserve bench compare` measures: a LocalCluster for `disagg:` and `unified:`,
bench/hf_server.py for `hf-sequential`; `openai:` and `zmq://` targets are already running and only named."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from mserve.bench.compare import ConfigSpec


def _http_get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback URL we built)
        return json.loads(resp.read())


@contextlib.contextmanager
def launched(spec: ConfigSpec, args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, str | None]]:
    """Start the configuration (if it is ours to start); yield (target URL, HTTP model name); always stop it."""
    if spec.kind == "cluster":
        from mserve.coordinator.launcher import LocalCluster

        extra = ["--dead-after-s", str(args.dead_after_s)] if args.dead_after_s is not None else []
        cluster = LocalCluster(args.model, **spec.pools, threads=args.threads, transfer=args.transfer,
                               log_dir=str(log_dir), extra_coordinator_args=[*extra, *spec.coordinator_args],
                               extra_worker_args=spec.worker_args,
                               cpu_placement=spec.cpu_placement or args.cpu_placement)  # the launcher logs it
        try:
            cluster.start(timeout_s=args.start_timeout)
            yield cluster.address, None
        finally:
            cluster.stop()
    elif spec.kind == "hf":
        from mserve.common.sockets import free_port

        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mserve.bench.hf_server", "--model", str(args.model), "--port", str(port),
               "--threads", str(args.threads), "--served-model-name", "hf-sequential"]
        with open(log_dir / "hf_server.log", "wb") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + args.start_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"hf_server exited with code {proc.returncode}; see {log_dir / 'hf_server.log'}")
                try:
                    _http_get_json(f"http://127.0.0.1:{port}/health", timeout=1.0)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("hf_server did not come up in time") from None
                    time.sleep(0.3)
            yield f"http://127.0.0.1:{port}/v1", "hf-sequential"
        finally:
            _stop_group(proc)
    elif spec.kind == "http":
        model = spec.request_model or args.openai_model
        if model is None:
            try:
                model = _http_get_json(spec.url.rstrip("/") + "/models")["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError) as exc:
                raise RuntimeError(f"cannot read {spec.url}/models ({exc}); pass --openai-model") from None
        yield spec.url, model
    else:
        yield spec.url, None


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
