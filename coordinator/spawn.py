"""How the launcher starts a child process: `exec` (a fresh `python -m mserve.cli ...`, the default) or
`forkserver` (a fork of one warm interpreter that has imported torch and transformers once).

Every child of a local cluster imports torch and transformers before it does anything else, 3-4 s of
CPU each, and a 1e1p1d cluster on two cores pays four of those at once. With `forkserver`,
multiprocessing's fork server imports them once (`PRELOAD`), and each child is a fork of it that then
runs `mserve.cli.main` with the command's arguments. From there on it is the same process as with
`exec`: its own session and process group, its log file as stdout and stderr, stdin from /dev/null, the
environment it was given, and the same exit code for the launcher.

The preloaded libraries read some environment variables at import (TORCH_*, OMP_*, HF_*, ...:
`IMPORT_READ_PREFIXES`), and those were read once, in the server. So a child whose environment differs
from the server's in one of those is started with `exec` instead, and the launcher's log says why; the
rest (MSERVE_*, REDIS_URL, ...) are read after the fork, from the environment the child was given.
What a forked child does not share with an exec'd one: its /proc/PID/cmdline and environ (what `ps`
shows) are the server's (the environment it runs with is set after the fork), and every child has the
server's string-hash seed (nothing in mserve uses `hash()` across processes; `random` is reseeded at
each fork). The autoscaler's local workers start the same way (mserve/autoscale/backends.py).

Like multiprocessing's own fork server, which this is, the program that starts the children must have
an import-safe main module (its work under `if __name__ == "__main__":`): each child imports it once.
A child still running when that program exits normally gets SIGTERM then (a daemon process).

MSERVE_START_METHOD=forkserver chooses it for every LocalCluster that does not choose itself (the test
suite sets it). On two cores a 1e1p1d cluster of a tiny checkpoint then starts in 2.0 s instead of
10-12 (the first in 6 s: it waits for the server's imports).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

START_METHODS = ("exec", "forkserver")
START_METHOD_ENV = "MSERVE_START_METHOD"
# What every child imports first, in the order they import it (the fork server skips any it cannot).
PRELOAD = ["numpy", "PIL.Image", "zmq", "msgpack", "redis", "pydantic", "torch", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.processing_auto"]
# The variables PRELOAD's libraries (and the interpreter, and the native libraries they load) may read
# while they import. A child's other variables, MSERVE_* among them, are read after the fork from the
# environment it was given, as in an exec'd child.
IMPORT_READ_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "NCCL_", "OMP_", "KMP_", "GOMP_", "MKL",
                        "DNNL_", "ONEDNN_", "OPENBLAS", "NPY_", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS",
                        "USE_", "XDG_", "LD_", "MALLOC_")
# PYTHONUNBUFFERED: the child's streams are unbuffered anyway. TORCHINDUCTOR_CACHE_DIR: read at each compile
# (torch writes its default into os.environ the first time, in the launcher as in the server).
_READ_AFTER = frozenset({"PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"})
_LEAD_TIMEOUT_S = 180.0  # the first fork waits for the server's imports (15 s on a loaded 2-core host)


class Child(Protocol):
    """What the launcher and the autoscaler use of a child: subprocess.Popen's pid, poll, wait, returncode and
    send_signal."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def default_start_method() -> str:
    method = os.environ.get(START_METHOD_ENV, "exec") or "exec"
    if method not in START_METHODS:
        raise ValueError(f"${START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {method!r}")
    return method


def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: this process's, unbuffered output, offline unless the environment says otherwise."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **extra}


def start(cmd: Sequence[str], env: Mapping[str, str], log_path: str, method: str = "exec") -> Child:
    """Start `cmd` (``[python, "-m", "mserve.cli", ...]``) in its own session, output to `log_path`."""
    if method == "forkserver":
        why = _forkserver.unfit(cmd, env)
        if why is None:
            return _forkserver.start(list(cmd[3:]), dict(env), log_path)
        logger.info("starting %s with exec, not the fork server: %s", " ".join(cmd[3:5]), why)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env), start_new_session=True)


def differing_keys(server: Mapping[str, str], child: Mapping[str, str]) -> list[str]:
    """The variables a forked child would see with another value than asked (read at the server's imports)."""
    keys = set(server) | set(child)
    return sorted(k for k in keys if server.get(k) != child.get(k)
                  and k.startswith(IMPORT_READ_PREFIXES) and k not in _READ_AFTER)


class ForkedChild:
    """A child forked by the fork server, with the subset of Popen's interface the launcher uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class _ForkServer:
    """multiprocessing's fork server for this process, with PRELOAD imported, started on first use."""

    def __init__(self) -> None:
        self._context = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()

    def unfit(self, cmd: Sequence[str], env: Mapping[str, str]) -> str | None:
        if list(cmd[1:3]) != ["-m", "mserve.cli"] or cmd[0] != sys.executable:
            return f"not an mserve.cli command of this interpreter: {' '.join(cmd[:3])}"
        server_env = self._env if self._context is not None else _with_defaults(os.environ)
        if keys := differing_keys(server_env, _with_defaults(env)):
            return f"its environment differs from the fork server's in {', '.join(keys[:5])}"
        return None

    def ensure(self) -> None:
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._context is None:
            from multiprocessing import forkserver

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            # The server inherits os.environ, with the defaults every mserve command sets before its imports.
            added = {k: v for k, v in _cli_env_defaults().items() if k not in os.environ}
            os.environ.update(added)
            try:
                self._env = dict(os.environ)
                forkserver.ensure_running()
            finally:
                for key in added:
                    os.environ.pop(key, None)
            self._context = context
            logger.info("fork server started: it imports %s once for every child", ", ".join(PRELOAD))

    def start(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedChild:
        with self._lock:  # one start at a time: the first starts the server
            self._ensure()
            open(log_path, "wb").close()
            led, leads = self._context.Pipe(duplex=False)
            process = self._context.Process(target=_child_main, args=(argv, env, log_path, leads),
                                            name=" ".join(argv[:2]), daemon=True)
            process.start()
            leads.close()
            try:  # returns once the child leads its own group, so the launcher may signal the group at once
                if not led.poll(_LEAD_TIMEOUT_S):
                    raise RuntimeError(f"fork server: the child (pid {process.pid}) did not start within "
                                       f"{_LEAD_TIMEOUT_S:.0f}s")
                led.recv()
            except EOFError:
                pass  # it died before: poll() reports its exit code
            finally:
                led.close()
            return ForkedChild(process)


_forkserver = _ForkServer()


def warm() -> None:
    """Start the fork server now, with this environment: its imports run while the caller goes on."""
    _forkserver.ensure()


def _cli_env_defaults() -> dict[str, str]:
    from mserve.cli import ENV_DEFAULTS

    return ENV_DEFAULTS


def _with_defaults(env: Mapping[str, str]) -> dict[str, str]:
    return {**_cli_env_defaults(), **env}


def _child_main(argv: list[str], env: dict[str, str], log_path: str, leads: Any) -> None:
    """In the forked child: become what `python -m mserve.cli ARGV` started by Popen would be, then run it."""
    os.setsid()  # its own session and process group, like start_new_session
    leads.send(True)
    leads.close()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  errors="backslashreplace")
    _own_resource_tracker()
    os.environ.clear()
    os.environ.update(env)
    import mserve.cli

    sys.argv = [mserve.cli.__file__, *argv]
    try:
        code = mserve.cli.main(argv)
    finally:
        logging.shutdown()
    sys.exit(code)


def _own_resource_tracker() -> None:
    """Start a multiprocessing resource tracker of its own on first use (for its shared memory), as an exec'd
    child does, in its process group. The fork server hands each child the launcher's tracker, which would
    outlive a killed worker and report the worker's segments as leaked when the launcher exits."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # private: the module has no public way to let go of it
    if getattr(tracker, "_fd", None) is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
