"""Starts a whole cluster on this host (redis, coordinator, worker pools) as child processes: for `mserve up`
(mserve/up.py), tests and the demo.

Each child runs `python -m mserve.cli ...` in its own process group (so a Ctrl-C aimed at the
launcher reaches only the launcher, which then stops the children in order, and a kill takes any
grandchildren along), with stdout+stderr in one log file per child.

Security (docs/operations.md): ``client_api_key`` reaches the children as $MSERVE_CLIENT_API_KEY, never
on a command line; ``curve_dir`` holds one CURVE keypair per process and ``authorized/`` (the workers'
public keys). Without them (the default) every link is unauthenticated: one trusted host only.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from mserve.common.redis_server import RedisServer

# zmq and the client are imported where used, so that `mserve --help`, which builds this module's
# parser, stays instant.

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
STAGE_ROLES = ("encode", "prefill", "decode", "unified")
_LOG_TAIL_LINES = 40


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message carries the failing processes' log tails."""


class LocalCluster:
    """A coordinator and worker pools on 127.0.0.1, ready once every worker shows alive in STATUS."""

    def __init__(self, model: str, *, encode: int = 1, prefill: int = 1, decode: int = 1, unified: int = 0,
                 redis_url: str | None = None, port: int | None = None, threads: int = 1, transfer: str = "auto",
                 extra_worker_args: Sequence[str] = (), extra_coordinator_args: Sequence[str] = (),
                 log_dir: str | None = None, client_api_key: str | None = None,
                 curve_dir: str | os.PathLike[str] | None = None) -> None:
        counts = {"encode": encode, "prefill": prefill, "decode": decode, "unified": unified}
        if any(n < 0 for n in counts.values()) or sum(counts.values()) == 0:
            raise ValueError(f"worker counts must be >= 0 with at least one worker, got {counts}")
        self.model = str(model)
        self.counts = counts
        self.threads = threads
        self.transfer = transfer
        self.extra_worker_args = list(extra_worker_args)
        self.extra_coordinator_args = list(extra_coordinator_args)
        self.client_api_key = client_api_key or None
        self.curve_dir = Path(curve_dir) if curve_dir is not None else None
        self._redis_url = redis_url or os.environ.get("REDIS_URL") or None
        self._port = port
        self._worker_port: int | None = None
        self._log_dir = log_dir
        self._own_log_dir = False
        # Each cluster gets its own L2 embedding cache (as its own Redis): runs never share state.
        self._host_cache_dir: str | None = None
        self._redis: RedisServer | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started = False

    # ---- what tests and callers read

    @property
    def address(self) -> str:
        """Where clients connect (the coordinator's client ROUTER)."""
        if self._port is None:
            raise RuntimeError("LocalCluster has no address until start()")
        return f"tcp://127.0.0.1:{self._port}"

    @property
    def worker_address(self) -> str:
        if self._worker_port is None:
            raise RuntimeError("LocalCluster has no worker address until start()")
        return f"tcp://127.0.0.1:{self._worker_port}"

    @property
    def redis_url(self) -> str:
        if self._redis_url is None:
            raise RuntimeError("LocalCluster has no redis until start()")
        return self._redis_url

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """name -> Popen: "coordinator" and every worker ("encode-0", "decode-1", ...)."""
        return dict(self._procs)

    @property
    def log_dir(self) -> str | None:
        return self._log_dir

    def worker_names(self, role: str | None = None) -> list[str]:
        """The worker ids this cluster starts, of one role or all, in start order."""
        roles = STAGE_ROLES if role is None else (role,)
        return [f"{r}-{i}" for r in roles for i in range(self.counts.get(r, 0))]

    def log_path(self, name: str) -> Path:
        if self._log_dir is None:
            raise RuntimeError("LocalCluster has no logs until start()")
        return Path(self._log_dir) / f"{name}.log"

    def log_tail(self, name: str, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except (OSError, RuntimeError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one child's process group (SIGKILL by default: a crash, no goodbye); reaps it if killed."""
        proc = self._procs.get(name)
        if proc is None:
            raise KeyError(f"no process {name!r}; have {sorted(self._procs)}")
        _signal_group(proc, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=STOP_GRACE_S)
        logger.info("%s: sent %s", name, signal.Signals(sig).name)

    # ---- commands

    def coordinator_command(self) -> list[str]:
        return [sys.executable, "-m", "mserve.cli", "coordinator", "--model", self.model,
                "--bind", self.address, "--worker-bind", self.worker_address, "--redis", self.redis_url,
                *self.curve_args("coordinator"), *self.extra_coordinator_args]

    def worker_command(self, name: str) -> list[str]:
        role = name.rsplit("-", 1)[0]
        return [sys.executable, "-m", "mserve.cli", "worker", "--role", role, "--model", self.model,
                "--coordinator", self.worker_address, "--redis", self.redis_url, "--threads", str(self.threads),
                "--transfer", self.transfer, "--worker-id", name, *self.curve_args(name),
                *(["--host-embedding-cache-dir", self._host_cache_dir] if self._host_cache_dir else []),
                *self.extra_worker_args]

    def curve_args(self, name: str) -> list[str]:
        """The CURVE flags of one child (none without ``curve_dir``): its own keypair, the authorized
        folder and, for a worker, the coordinator's public key."""
        if self.curve_dir is None:
            return []
        d = self.curve_dir
        args = ["--curve-secret-key", str(d / f"{name}.key_secret"), "--curve-authorized-keys", str(d / "authorized")]
        return args if name == "coordinator" else [*args, "--curve-server-key", str(d / "coordinator.key")]



    # ---- lifecycle

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        if self._started:
            return self
        self._started = True
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            self._prepare()
            self._spawn("coordinator", self.coordinator_command())
            for name in self.worker_names():
                self._spawn(name, self.worker_command(name))
            self._wait_ready(t0 + timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("cluster ready in %.1fs: %s at %s", time.monotonic() - t0, self._describe(), self.address)
        return self

    def _prepare(self) -> None:
        from mserve.common.sockets import free_port

        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="mserve-cluster-")
            self._own_log_dir = True
        os.makedirs(self._log_dir, exist_ok=True)
        self._host_cache_dir = tempfile.mkdtemp(prefix="mserve-emb-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                else None)
        if self.curve_dir is not None:
            from mserve.common.security import cluster_keys

            cluster_keys(self.curve_dir, servers=["coordinator"], peers=self.worker_names())
        if self._redis_url is None:
            logger.info("starting a private redis-server")
            self._redis = RedisServer().start()
            self._redis_url = self._redis.url
        logger.info("redis at %s", self._redis_url)
        if self._port is None:
            self._port = free_port()
        self._worker_port = free_port()
        while self._worker_port == self._port:
            self._worker_port = free_port()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        if self.client_api_key:  # the coordinator requires it, the gateway's client sends it
            env["MSERVE_CLIENT_API_KEY"] = self.client_api_key
        with open(self.log_path(name), "wb") as log:  # the child keeps its own descriptor
            self._procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                 env=env, start_new_session=True)
        logger.info("started %s (pid %d), log %s", name, self._procs[name].pid, self.log_path(name))

    def _wait_ready(self, deadline: float) -> None:
        from mserve.coordinator.client import Client, MServeError

        expected = self.worker_names()
        logger.info("waiting for %d worker(s) to report alive: %s", len(expected), ", ".join(expected))
        alive: set[str] = set()
        last_error = "no STATUS reply yet"
        with Client(self.address, timeout_s=1.0, api_key=self.client_api_key) as client:
            while True:
                self._fail_if_exited()
                try:
                    workers = client.status(timeout_s=1.0).get("workers", {})
                    now_alive = {w for w, info in workers.items() if info.get("alive")}
                    for name in sorted((now_alive & set(expected)) - alive):
                        logger.info("%s is alive", name)
                    alive = now_alive
                    if set(expected) <= alive:
                        return
                except MServeError as exc:
                    last_error = str(exc)
                if time.monotonic() >= deadline:
                    missing = [n for n in expected if n not in alive]
                    names = ["coordinator", *missing] if missing else ["coordinator"]
                    raise ClusterStartError(
                        f"cluster not ready before the deadline: not alive: {missing or 'none'} "
                        f"(last status error: {last_error})\n" + self._tails(names))
                time.sleep(0.2)

    def start_gateway(self, port: int | None = None, extra_args: Sequence[str] = (),
                      timeout_s: float = 60.0, require_serving: bool = True) -> str:
        """Start an OpenAI-compatible HTTP gateway for this cluster; returns its base URL once /health says
        the cluster serves (or, with ``require_serving=False``, once the gateway answers at all)."""
        import urllib.error
        import urllib.request

        from mserve.common.sockets import free_port

        port = port or free_port()
        self._spawn("gateway", [sys.executable, "-m", "mserve.cli", "gateway", "--coordinator", self.address,
                                "--port", str(port), "--model", self.model, *extra_args])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            self._fail_if_exited()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2.0) as reply:
                    if reply.status == 200:
                        return url
            except urllib.error.HTTPError as exc:  # 503 until a worker can serve
                if exc.code == 503 and not require_serving:
                    return url
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise ClusterStartError(f"gateway not healthy within {timeout_s:.0f}s\n" + self._tails(["gateway"]))
            time.sleep(0.2)

    def _fail_if_exited(self) -> None:
        dead = [n for n, p in self._procs.items() if p.poll() is not None]
        if dead:
            codes = ", ".join(f"{n} exited with code {self._procs[n].returncode}" for n in dead)
            raise ClusterStartError(f"cluster start-up failed: {codes}\n" + self._tails(dead))

    def _tails(self, names: Sequence[str]) -> str:
        return "\n".join(f"---- {n} ({self.log_path(n)}), last lines:\n{self.log_tail(n)}" for n in names)

    def _describe(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in self.counts.items() if n)

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period, stop the private redis."""
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit within %.0fs of SIGTERM: killing it", name, STOP_GRACE_S)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._host_cache_dir is not None:
            shutil.rmtree(self._host_cache_dir, ignore_errors=True)
            self._host_cache_dir = None
        if self._own_log_dir and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir, self._own_log_dir = None, False
        if self._started:
            atexit.unregister(self.stop)
            logger.info("cluster stopped")
        self._started = False

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
    except ProcessLookupError:
        pass
