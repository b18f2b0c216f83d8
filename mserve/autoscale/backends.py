"""Where a replica count becomes workers: local processes, docker compose services, Kubernetes Deployments.

Every backend answers the same three questions: how many replicas each pool has now (`replicas`),
how to get a pool from one count to another (`scale`, returning a sentence saying what it did or
would do), and what happened since the last tick (`poll`). Scale-down always goes through the
worker's drain (SIGTERM: no new work, finish, exit when the coordinator releases it): the local
backend sends SIGTERM itself; docker compose and Kubernetes send it when they remove a container or
pod (keep their kill grace above the worker's `--drain-timeout-s`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from mserve.autoscale import POOLS
from mserve.coordinator import spawn

log = logging.getLogger("mserve.autoscale")


class BackendError(RuntimeError):
    """A scale action failed; the pool's count is left as it was and the next tick decides again."""


def _snapshot_ready(snap: Any, pool: str) -> list[str]:
    return list(getattr(snap, "ready_ids", {}).get(pool, []))


# --------------------------------------------------------------------------- local processes


@dataclass
class _Proc:
    name: str
    role: str
    popen: spawn.Child
    started_at: float
    adopted: bool = False  # started by someone else (a LocalCluster): stopped by scale-down, left alone on close
    draining_since: float | None = None


class LocalBackend:
    """`mserve worker` processes on this host, each in its own session, logs in `log_dir`.

    Replicas of a pool = the workers this backend runs (starting or serving, not draining) + the
    serving workers it did not start (from the observation). Scale-down drains the newest workers it
    runs first; workers it neither started nor adopted are never touched."""

    name = "local"

    def __init__(self, model: str, worker_address: str, redis_url: str | None, *, threads: int = 1,
                 transfer: str = "auto", extra_args: Sequence[str] = (), log_dir: str | None = None,
                 dry_run: bool = False, kill_after_s: float = 60.0, id_prefix: str | None = None,
                 python: str = sys.executable) -> None:
        self.model, self.worker_address, self.redis_url = str(model), worker_address, redis_url
        self.threads, self.transfer, self.extra_args = threads, transfer, list(extra_args)
        self.dry_run = dry_run
        self.kill_after_s = kill_after_s  # a draining worker still alive this long after SIGTERM is killed
        self.python = python
        self.id_prefix = id_prefix or f"as{os.getpid()}"
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mserve-autoscale-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, _Proc] = {}
        self._seq = 0
        self._virtual: dict[str, int] = {}  # dry run: the counts it would have set

    def worker_command(self, name: str, role: str) -> list[str]:
        cmd = [self.python, "-m", "mserve.cli", "worker", "--role", role, "--model", self.model,
               "--coordinator", self.worker_address, "--threads", str(self.threads), "--transfer", self.transfer,
               "--worker-id", name]
        if self.redis_url:
            cmd += ["--redis", self.redis_url]
        return cmd + self.extra_args

    def adopt(self, name: str, role: str, popen: spawn.Child) -> None:
        """Let this backend drain a worker someone else started (e.g. one of a LocalCluster's)."""
        self.procs[name] = _Proc(name, role, popen, time.monotonic(), adopted=True)

    def running(self, pool: str) -> list[_Proc]:
        """This backend's workers of a pool that are running and not draining, oldest first."""
        return [p for p in self.procs.values()
                if p.role == pool and p.draining_since is None and p.popen.poll() is None]

    def draining(self) -> list[str]:
        return [p.name for p in self.procs.values() if p.draining_since is not None]

    def replicas(self, snap: Any) -> dict[str, int]:
        out = {}
        for pool in POOLS:
            if pool in self._virtual:
                out[pool] = self._virtual[pool]
                continue
            others = [w for w in _snapshot_ready(snap, pool) if w not in self.procs]
            out[pool] = len(self.running(pool)) + len(others)
        return out

    def scale(self, pool: str, current: int, desired: int) -> str:
        if self.dry_run:
            self._virtual[pool] = desired
            verb = "start" if desired > current else "drain"
            return f"(dry run) would {verb} {abs(desired - current)} {pool} worker(s)"
        if desired > current:
            return "started " + ", ".join(self._spawn(pool) for _ in range(desired - current))
        mine = sorted(self.running(pool), key=lambda p: p.started_at, reverse=True)  # newest first
        victims = mine[:current - desired]
        for p in victims:
            self._signal(p, signal.SIGTERM)
            p.draining_since = time.monotonic()
        said = "draining " + ", ".join(f"{p.name} (pid {p.popen.pid}, SIGTERM)" for p in victims) if victims else ""
        short = current - desired - len(victims)
        if short:
            msg = f"{short} {pool} worker(s) to remove were not started by this autoscaler: left running"
            if not victims:
                raise BackendError(msg)
            said += f"; {msg}"
        return said

    def _spawn(self, pool: str) -> str:
        self._seq += 1
        name = f"{pool}-{self.id_prefix}-{self._seq}"
        path = self.log_dir / f"{name}.log"
        try:  # exec, or a fork of the warm fork server with MSERVE_START_METHOD=forkserver (coordinator/spawn.py)
            popen = spawn.start(self.worker_command(name, pool), spawn.child_env(), str(path),
                                spawn.default_start_method())
        except OSError as exc:
            raise BackendError(f"could not start a {pool} worker: {exc}") from exc
        self.procs[name] = _Proc(name, pool, popen, time.monotonic())
        return f"{name} (pid {popen.pid}, log {path})"

    @staticmethod
    def _signal(p: _Proc, sig: int) -> None:
        if p.popen.poll() is not None:
            return
        try:
            if p.adopted:  # not necessarily the leader of its own process group
                p.popen.send_signal(sig)
            else:
                os.killpg(p.popen.pid, sig)
        except ProcessLookupError:
            pass

    def poll(self) -> list[str]:
        """Reap workers that exited; kill a drain that overran. Returns what happened, for the log."""
        events = []
        now = time.monotonic()
        for name, p in list(self.procs.items()):
            code = p.popen.poll()
            if code is not None:
                del self.procs[name]
                if p.draining_since is not None:
                    took = now - p.draining_since
                    events.append(f"{name} drained and exited (code {code}) {took:.1f}s after SIGTERM")
                else:
                    events.append(f"{name} exited unexpectedly (code {code}); see {self.log_dir / (name + '.log')}")
            elif p.draining_since is not None and now - p.draining_since > self.kill_after_s:
                self._signal(p, signal.SIGKILL)
                events.append(f"{name} still draining {self.kill_after_s:g}s after SIGTERM: killed")
        return events

    def close(self, stop_workers: bool = True, timeout_s: float = 30.0) -> None:
        """Drain every worker this backend started (not adopted ones) and wait for them, then kill leftovers."""
        for event in self.poll():
            log.info("%s", event)
        if not stop_workers:
            return
        own = [p for p in self.procs.values() if not p.adopted and p.popen.poll() is None]
        for p in own:
            if p.draining_since is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in own:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not finish draining within %.0fs: killing it", p.name, timeout_s)
                self._signal(p, signal.SIGKILL)
                p.popen.wait()


# --------------------------------------------------------------------------- external tools


class _CommandBackend:
    """A backend that applies a count by running a command (docker compose, kubectl); the counts it set
    are remembered, the others come from the observation."""

    name = ""
    tool = ""

    def __init__(self, dry_run: bool = False) -> None:
        self.dry_run = dry_run
        self.targets: dict[str, int] = {}
        self._available: bool | None = None

    def command(self, pool: str, replicas: int) -> list[str]:
        raise NotImplementedError

    def probe(self) -> bool:
        raise NotImplementedError

    def available(self) -> bool:
        if self._available is None:
            self._available = shutil.which(self.tool) is not None and self.probe()
        return self._available

    def replicas(self, snap: Any) -> dict[str, int]:
        return {pool: self.targets.get(pool, len(_snapshot_ready(snap, pool))) for pool in POOLS}

    def scale(self, pool: str, current: int, desired: int) -> str:
        cmd = self.command(pool, desired)
        shown = " ".join(_quote(c) for c in cmd)
        if self.dry_run:
            self.targets[pool] = desired
            return f"(dry run) would run: {shown}"
        if not self.available():
            self.targets[pool] = desired
            return f"{self.tool} is not usable here, not run: {shown}"
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"{shown}: {exc}") from exc
        if done.returncode != 0:
            raise BackendError(f"{shown}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}")
        self.targets[pool] = desired
        return f"ran: {shown}"

    def poll(self) -> list[str]:
        return []

    def close(self, stop_workers: bool = True, timeout_s: float = 30.0) -> None:
        pass


def _quote(s: str) -> str:
    return s if s and all(c.isalnum() or c in "-_=./:,@" for c in s) else "'" + s.replace("'", "'\\''") + "'"


def _quiet_ok(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class ComposeBackend(_CommandBackend):
    """`docker compose up -d --no-recreate --no-deps --scale SERVICE=N SERVICE`, one pool per command:
    naming the service keeps compose from resetting the other pools to their file's counts, and
    --no-recreate keeps running replicas as they are. Compose stops the highest-numbered containers
    when scaling down (SIGTERM, then SIGKILL after the service's stop_grace_period)."""

    name = "compose"
    tool = "docker"

    def __init__(self, compose_file: str | None = None, project: str | None = None,
                 services: Mapping[str, str] | None = None, dry_run: bool = False, docker: str = "docker",
                 compose_command: Sequence[str] | None = None) -> None:
        super().__init__(dry_run)
        self.compose_file, self.project, self.tool = compose_file, project, docker
        # `docker compose` (the plugin) by default; ["docker-compose"] where only compose v1 is installed.
        self.compose = list(compose_command) if compose_command else [docker, "compose"]
        self.services = {pool: pool for pool in POOLS}
        self.services.update(services or {})

    def command(self, pool: str, replicas: int) -> list[str]:
        svc = self.services[pool]
        cmd = list(self.compose)
        if self.compose_file:
            cmd += ["-f", self.compose_file]
        if self.project:
            cmd += ["-p", self.project]
        return cmd + ["up", "-d", "--no-recreate", "--no-deps", "--scale", f"{svc}={int(replicas)}", svc]

    def probe(self) -> bool:  # the compose command, and an engine answering
        return _quiet_ok([*self.compose, "version"]) and _quiet_ok([self.tool, "info"])


def compose_services(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The services a compose file defines (name -> its mapping)."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text()) or {}
    services = doc.get("services") or {}
    return {str(k): (v or {}) for k, v in services.items()}


class KubernetesBackend(_CommandBackend):
    """Sets `spec.replicas` of the Deployment of each pool (default `mserve-encode|prefill|decode`),
    as `kubectl scale deployment/NAME --replicas=N` or, with mode "patch", as the JSON patch
    `[{"op": "replace", "path": "/spec/replicas", "value": N}]` (`kubectl patch --type=json`).
    The ReplicaSet picks which pods go; each gets SIGTERM and drains within its
    terminationGracePeriodSeconds."""

    name = "k8s"
    tool = "kubectl"

    def __init__(self, namespace: str | None = None, deployments: Mapping[str, str] | None = None,
                 context: str | None = None, mode: str = "scale", dry_run: bool = False,
                 kubectl: str = "kubectl") -> None:
        super().__init__(dry_run)
        if mode not in ("scale", "patch"):
            raise ValueError(f"mode must be 'scale' or 'patch', got {mode!r}")
        self.namespace, self.context, self.mode, self.tool = namespace, context, mode, kubectl
        self.deployments = {pool: f"mserve-{pool}" for pool in POOLS}
        self.deployments.update(deployments or {})

    @staticmethod
    def patch(replicas: int) -> list[dict[str, Any]]:
        return [{"op": "replace", "path": "/spec/replicas", "value": int(replicas)}]

    def command(self, pool: str, replicas: int) -> list[str]:
        cmd = [self.tool]
        if self.context:
            cmd += ["--context", self.context]
        if self.namespace:
            cmd += ["-n", self.namespace]
        name = self.deployments[pool]
        if self.mode == "patch":
            return cmd + ["patch", "deployment", name, "--type=json", "-p", json.dumps(self.patch(replicas))]
        return cmd + ["scale", f"deployment/{name}", f"--replicas={int(replicas)}"]

    def probe(self) -> bool:  # a configured context (read locally, no API call)
        return _quiet_ok([self.tool, *(["--context", self.context] if self.context else []), "config",
                          "current-context"])


def k8s_deployments(folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every Deployment in the manifests under a folder (*.yaml / *.yml, multi-document): name -> object."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Deployment":
                out[str((doc.get("metadata") or {}).get("name"))] = doc
    return out
