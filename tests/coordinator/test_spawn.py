"""How the launcher starts a child (coordinator/spawn.py): a fork of the warm fork server behaves like a fresh
`python -m mserve.cli` for everything the launcher and the child rely on. Real processes: an mserve
coordinator (no model, no Redis) started each way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mserve.common.sockets import free_port
from mserve.coordinator import spawn
from mserve.coordinator.launcher import LocalCluster

METHODS = ("exec", "forkserver")


def coordinator_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "mserve.cli", "coordinator", "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--worker-bind", f"tcp://127.0.0.1:{free_port()}", *extra]


def wait_for_line(child: spawn.Child, log: Path, text: str) -> None:
    """Until the child's log has `text` (it is still running), failing with the log if it exits."""
    while text not in log.read_text(errors="replace"):
        if child.poll() is not None:
            pytest.fail(f"exited with {child.returncode} before logging {text!r}:\n{log.read_text()}")
        try:
            child.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass


@pytest.mark.parametrize("method", METHODS)
def test_a_child_leads_its_group_logs_and_stops_by_signal(method, tmp_path):
    log = tmp_path / "coordinator.log"
    child = spawn.start(coordinator_cmd(), spawn.child_env(MSERVE_CLIENT_API_KEY="k"), str(log), method)
    assert isinstance(child, subprocess.Popen) == (method == "exec")
    try:
        # Its own session and process group from the moment start() returns (the launcher signals the group).
        assert os.getpgid(child.pid) == child.pid and os.getsid(child.pid) == child.pid
        wait_for_line(child, log, "client link: API key required")  # the environment it was given
        assert Path(f"/proc/{child.pid}/fd/0").resolve() == Path(os.devnull)
        assert child.poll() is None
    finally:
        os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=30) == 0  # the coordinator's own SIGTERM handling, the same either way
    assert child.returncode == 0 and child.poll() == 0


@pytest.mark.parametrize("method", METHODS)
def test_exit_codes_and_errors_reach_the_launcher(method, tmp_path):
    log = tmp_path / "bad.log"
    child = spawn.start(coordinator_cmd("--no-such-flag"), spawn.child_env(), str(log), method)
    assert child.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-flag" in log.read_text()

    log = tmp_path / "killed.log"
    child = spawn.start(coordinator_cmd(), spawn.child_env(), str(log), method)
    wait_for_line(child, log, "coordinator ready")
    child.send_signal(signal.SIGKILL)  # the autoscaler signals a worker it did not start this way
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.send_signal(signal.SIGKILL)  # an exited child: nothing to signal, no error


def test_a_child_whose_environment_the_server_did_not_import_with_is_execed(tmp_path, caplog):
    """Preloaded libraries read TORCH_*, OMP_*, HF_* ... at import: a child asking for other values gets exec;
    other variables (MSERVE_*, REDIS_URL) reach a forked child as given."""
    assert spawn.differing_keys({"A": "1", "MSERVE_X": "1", "TORCHINDUCTOR_CACHE_DIR": "/a"},
                                {"A": "2", "MSERVE_X": "2", "PYTHONUNBUFFERED": "1"}) == []  # read after the fork
    assert spawn.differing_keys({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                                {"HF_HUB_OFFLINE": "0", "PYTHONHASHSEED": "0"}) == \
        ["HF_HUB_OFFLINE", "OMP_NUM_THREADS", "PYTHONHASHSEED"]
    log = tmp_path / "c.log"
    with caplog.at_level("INFO", logger="mserve.coordinator.spawn"):
        child = spawn.start(coordinator_cmd("--no-such-flag"), spawn.child_env(TORCH_SPAWN_TEST="1"), str(log),
                            "forkserver")
    assert isinstance(child, subprocess.Popen)
    assert "with exec, not the fork server: its environment differs from the fork server's in TORCH_SPAWN_TEST" \
        in caplog.text
    assert child.wait(timeout=60) == 2


def test_start_methods_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="start_method must be one of exec, forkserver, got 'fork'"):
        LocalCluster("m", start_method="fork")
    monkeypatch.setenv(spawn.START_METHOD_ENV, "spawn")
    with pytest.raises(ValueError, match=r"\$MSERVE_START_METHOD must be one of exec, forkserver, got 'spawn'"):
        LocalCluster("m")
    monkeypatch.setenv(spawn.START_METHOD_ENV, "exec")
    assert LocalCluster("m").start_method == "exec"
