"""Hosts for tests, made of Linux namespaces: each "host" has its own network namespace (joined to
the others through a bridge), its own IPC namespace and a private tmpfs on /dev/shm, so neither
addresses nor POSIX shared memory cross from one host to another.

Layout (every name starts with the run's prefix, ``mserve-mh-{pid}-``; nothing is made in the root
namespace but the namespaces' names):

    switch namespace:   bridge ``br0``, one veth end ``p-{host}`` per host
    host namespace:     ``lo`` up, ``eth0`` (the other veth end) with ``{subnet}.{n}/24``

Each host has an *anchor*: a ``sleep infinity`` started under ``ip netns exec NS unshare --ipc
--mount`` that mounted the private /dev/shm. Every process of the host joins the anchor's network,
IPC and mount namespaces with ``nsenter``, so the host's processes share shared memory with each
other and with nobody else (``mserve.common.transfer.backends.host_id`` differs per host).

``Fabric.close()`` kills every process in every namespace of the run and deletes the namespaces
(their veths and the bridge go with them); stale namespaces left by a run whose process is gone
(a killed pytest) are swept when the next run starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Sequence

from mserve.common.transfer.shm_pool import pid_alive

PREFIX = "mserve-mh-"
_TOOLS = ("ip", "unshare", "nsenter", "mount")


def unavailable_reason() -> str | None:
    """Why this machine cannot make the test's hosts (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_SYS_ADMIN + CAP_NET_ADMIN)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2 and util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
        br = _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], check=False)
        if br.returncode != 0:
            return f"cannot make a bridge in a network namespace: {br.stderr.strip()}"
        veth = _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair in a network namespace: {veth.stderr.strip()}"
        shm = _run(["ip", "netns", "exec", probe, "unshare", "--ipc", "--mount", "--propagation", "private",
                    "mount", "-t", "tmpfs", "tmpfs", "/dev/shm"], check=False)
        if shm.returncode != 0:
            return f"cannot unshare IPC/mount namespaces with a private /dev/shm: {shm.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def netns_pids(ns: str) -> list[int]:
    """Live processes whose network namespace is ``ns`` (zombies are not listed)."""
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def _kill_all(ns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left (a process may fork while we kill)."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.02)  # the kernel tears them down; then look again


def sweep_stale() -> None:
    """Delete namespaces (and kill their processes) left by earlier runs whose process is gone."""
    out = _run(["ip", "netns", "list"], check=False)
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        _kill_all(name)
        _run(["ip", "netns", "del", name], check=False)


class Host:
    """One "host": a network namespace plus the anchor holding its IPC and mount namespaces."""

    def __init__(self, fabric: Fabric, name: str, ns: str, address: str) -> None:
        self.fabric = fabric
        self.name = name
        self.ns = ns
        self.address = address
        self.anchor: subprocess.Popen[bytes] | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start_anchor(self) -> None:
        script = "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity"
        self.anchor = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--ipc", "--mount", "--propagation", "private",
             "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)

    def _anchor_ready(self) -> None:
        assert self.anchor is not None and self.anchor.stdout is not None
        line = self.anchor.stdout.readline()  # "ready" once /dev/shm is private, EOF if it failed
        if line.strip() != b"ready":
            self.anchor.wait(timeout=10)
            err = self.anchor.stderr.read().decode(errors="replace") if self.anchor.stderr else ""
            raise RuntimeError(f"host {self.name}: anchor failed ({self.anchor.returncode}): {err.strip()}")

    def enter(self, cmd: Sequence[str], cwd: str | None = None) -> list[str]:
        """``cmd`` run inside this host (its network, IPC and mount namespaces), in ``cwd`` (entering a
        mount namespace moves to its root otherwise)."""
        assert self.anchor is not None
        wd = [f"--wd={cwd}"] if cwd else []
        return ["nsenter", "-t", str(self.anchor.pid), "--net", "--ipc", "--mount", *wd, "--", *cmd]

    def spawn(self, name: str, cmd: Sequence[str], *, log: Path | None = None, env: dict[str, str] | None = None,
              stdin: int | IO[bytes] | None = subprocess.DEVNULL, stdout: int | IO[bytes] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` on this host, in its own session, output to ``log`` (unless ``stdout`` is given).
        nsenter execs the command, so the Popen's pid is the command's own."""
        with open(log, "wb") if log is not None else open(os.devnull, "wb") as out:
            proc = subprocess.Popen(self.enter(cmd, cwd), stdin=stdin, stdout=stdout if stdout is not None else out,
                                    stderr=out, env=env, cwd=cwd, start_new_session=True)
        self.procs[name] = proc
        return proc

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "-n", self.ns, *args], check=check)

    def pids(self) -> list[int]:
        return netns_pids(self.ns)

    def signal_all(self, signum: int) -> None:
        """Send `signum` to every process in the host's namespace (SIGSTOP freezes the host, SIGCONT thaws it)."""
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """The host dies: SIGKILL every process in its namespace (anchor included) and reap ours."""
        _kill_all(self.ns)
        for proc in [*self.procs.values(), *([self.anchor] if self.anchor else [])]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed above
                pass


class Fabric:
    """A switch (bridge) and ``hosts`` on ``{subnet}.1``, ``{subnet}.2``, ... in namespaces of their own."""

    def __init__(self, hosts: Sequence[str], subnet: str = "10.231.0") -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.switch = f"{self.prefix}sw"
        self.subnet = subnet
        self.hosts = {h: Host(self, h, f"{self.prefix}{h}", f"{subnet}.{i}") for i, h in enumerate(hosts, start=1)}
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> Fabric:
        sweep_stale()
        try:
            self._add_ns(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host in self.hosts.values():
                self._add_ns(host.ns)
                port = f"p-{host.name}"[:15]
                host.ip("link", "set", "lo", "up")
                host.ip("link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
                _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
                host.ip("addr", "add", f"{host.address}/24", "dev", "eth0")
                host.ip("link", "set", "eth0", "up")
            for host in self.hosts.values():
                host._start_anchor()
            for host in self.hosts.values():
                host._anchor_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)

    def close(self) -> None:
        """Kill every process of every host, then delete the namespaces (veths and bridge go with them)."""
        errors = []
        for ns in reversed(self._made):
            try:
                _kill_all(ns)
            except RuntimeError as exc:  # pragma: no cover
                errors.append(str(exc))
        for host in self.hosts.values():
            for proc in [*host.procs.values(), *([host.anchor] if host.anchor else [])]:
                if proc.poll() is None:
                    try:
                        proc.kill()
                        proc.wait(timeout=5)
                    except (OSError, subprocess.TimeoutExpired):  # pragma: no cover
                        pass
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        for ns in reversed(self._made):
            out = _run(["ip", "netns", "del", ns], check=False)
            if out.returncode != 0:  # pragma: no cover
                errors.append(f"ip netns del {ns}: {out.stderr.strip()}")
        self._made = []
        if errors:  # pragma: no cover
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Fabric:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
