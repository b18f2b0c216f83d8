"""What each backend runs for a replica count (compose, kubectl: built, never executed here), the local
backend's process bookkeeping (with a stand-in for `mserve worker`), and the CLI's flags."""

from __future__ import annotations

import copy
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mserve.autoscale.backends import (BackendError, ComposeBackend, KubernetesBackend, LocalBackend, compose_services,
                                       k8s_deployments)

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"


def snap(**ready: list[str]):
    return SimpleNamespace(ready_ids={"encode": [], "prefill": [], "decode": [], **ready})


# -- docker compose ------------------------------------------------------------------------------------------

def test_compose_command_scales_one_service_without_touching_the_others():
    b = ComposeBackend()
    assert b.command("decode", 3) == ["docker", "compose", "up", "-d", "--no-recreate", "--no-deps",
                                      "--scale", "decode=3", "decode"]
    b = ComposeBackend("deploy/docker-compose.yml", "mserve", {"encode": "vision"})
    assert b.command("encode", 0) == ["docker", "compose", "-f", "deploy/docker-compose.yml", "-p", "mserve", "up",
                                      "-d", "--no-recreate", "--no-deps", "--scale", "vision=0", "vision"]


def test_compose_command_can_be_compose_v1():
    b = ComposeBackend("deploy/docker-compose.yml", None, compose_command=["docker-compose"])
    assert b.command("decode", 2) == ["docker-compose", "-f", "deploy/docker-compose.yml", "up", "-d", "--no-recreate",
                                      "--no-deps", "--scale", "decode=2", "decode"]


def test_compose_dry_run_and_missing_docker_record_the_target_without_running():
    b = ComposeBackend(dry_run=True)
    assert b.replicas(snap(decode=["d0"]))["decode"] == 1  # nothing set yet: what serves
    said = b.scale("decode", 1, 2)
    assert said == "(dry run) would run: docker compose up -d --no-recreate --no-deps --scale decode=2 decode"
    assert b.replicas(snap(decode=["d0"]))["decode"] == 2
    b = ComposeBackend(docker="/nonexistent/docker")
    assert b.scale("prefill", 1, 2).startswith("/nonexistent/docker is not usable here, not run: ")
    assert b.targets == {"prefill": 2}


def test_compose_services_are_the_pool_names_in_the_repository_file():
    services = compose_services(COMPOSE_FILE)
    for pool, svc in ComposeBackend().services.items():
        assert svc in services, f"{pool}: service {svc!r} not in {COMPOSE_FILE}"


# -- Kubernetes ------------------------------------------------------------------------------------------------

def test_kubectl_scale_and_json_patch_commands():
    b = KubernetesBackend(namespace="serving", context="prod")
    assert b.command("prefill", 4) == ["kubectl", "--context", "prod", "-n", "serving", "scale",
                                       "deployment/mserve-prefill", "--replicas=4"]
    p = KubernetesBackend(mode="patch", deployments={"encode": "vision"})
    cmd = p.command("encode", 0)
    assert cmd[:5] == ["kubectl", "patch", "deployment", "vision", "--type=json"] and cmd[5] == "-p"
    assert json.loads(cmd[6]) == [{"op": "replace", "path": "/spec/replicas", "value": 0}]
    said = KubernetesBackend(dry_run=True).scale("decode", 1, 3)
    assert said == "(dry run) would run: kubectl scale deployment/mserve-decode --replicas=3"
    with pytest.raises(ValueError):
        KubernetesBackend(mode="apply")


def _apply_patch(doc: dict, patch: list[dict]) -> dict:
    """RFC 6902 'replace' (all the backend emits): the path must exist."""
    out = copy.deepcopy(doc)
    for op in patch:
        assert op["op"] == "replace"
        *parents, leaf = op["path"].strip("/").split("/")
        node = out
        for key in parents:
            node = node[key]
        assert leaf in node, f"replace needs {op['path']} to exist"
        node[leaf] = op["value"]
    return out


@pytest.mark.skipif(not K8S_DIR.is_dir(), reason="no deploy/k8s manifests in this checkout")
def test_the_deployments_the_k8s_backend_scales_exist_in_the_manifests_and_take_the_patch():
    deployments = k8s_deployments(K8S_DIR)
    b = KubernetesBackend(mode="patch")
    for pool, name in b.deployments.items():
        assert name in deployments, f"{pool}: Deployment {name!r} not in {K8S_DIR} (have {sorted(deployments)})"
        patched = _apply_patch(deployments[name], b.patch(3))
        assert patched["spec"]["replicas"] == 3
        try:
            import kubernetes_validate
        except ImportError:
            continue
        kubernetes_validate.validate(patched, "1.30.0", strict=True)  # still a valid apps/v1 Deployment


# -- local processes (a stand-in worker: sleeps until SIGTERM, then "drains" and exits) ------------------------

@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """A stand-in for `python -m mserve.cli worker ...`: says it is up (a file named by its pid in
    $FAKE_READY), exits 0 a moment after SIGTERM."""
    monkeypatch.setenv("FAKE_READY", str(tmp_path))
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\ntrap 'sleep 0.2; exit 0' TERM\ntouch \"$FAKE_READY/$$\"\n"
                      "while :; do sleep 0.05; done\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def up(tmp_path, b):
    """Wait until each of the backend's stand-ins has its SIGTERM trap set."""
    wait_for(lambda: all((tmp_path / str(p.popen.pid)).exists() for p in b.procs.values()))


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_local_worker_command():
    b = LocalBackend("models/tiny-llava", "tcp://127.0.0.1:5556", "redis://h:1/0", threads=2, transfer="tcp",
                     extra_args=["--num-blocks", "64"], id_prefix="t")
    assert b.worker_command("decode-t-1", "decode") == [
        sys.executable, "-m", "mserve.cli", "worker", "--role", "decode", "--model", "models/tiny-llava",
        "--coordinator", "tcp://127.0.0.1:5556", "--threads", "2", "--transfer", "tcp", "--worker-id", "decode-t-1",
        "--redis", "redis://h:1/0", "--num-blocks", "64"]


def test_local_backend_starts_counts_drains_newest_first_and_reaps(tmp_path, fake_python):
    b = LocalBackend("m", "tcp://x", None, log_dir=str(tmp_path / "logs"), python=fake_python, id_prefix="t")
    try:
        said = b.scale("decode", 1, 3)  # one serving worker it did not start (d0) + 2 new
        assert said.startswith("started decode-t-1 (pid ") and "decode-t-2" in said
        assert b.replicas(snap(decode=["d0"]))["decode"] == 3
        assert b.replicas(snap(decode=["d0", "decode-t-1"]))["decode"] == 3  # its own are not counted twice
        up(tmp_path, b)
        said = b.scale("decode", 3, 2)
        assert said.startswith("draining decode-t-2 (pid ") and "SIGTERM" in said  # the newest
        assert b.draining() == ["decode-t-2"] and b.replicas(snap(decode=["d0"]))["decode"] == 2
        events: list[str] = []
        wait_for(lambda: bool(events.extend(b.poll()) or events))
        assert events[0].startswith("decode-t-2 drained and exited (code 0)")
        with pytest.raises(BackendError, match="not started by this autoscaler"):
            b.scale("prefill", 1, 0)  # only someone else's worker there
        said = b.scale("decode", 2, 0)  # one of its own, one not
        assert "draining decode-t-1" in said and "1 decode worker(s) to remove were not started" in said
    finally:
        b.close(timeout_s=5)
    assert all(p.popen.poll() is not None for p in b.procs.values())


def test_local_backend_reports_a_crash_and_kills_an_overrunning_drain(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_READY", str(tmp_path))
    stubborn = tmp_path / "stubborn"
    stubborn.write_text("#!/bin/sh\ntrap '' TERM\ntouch \"$FAKE_READY/$$\"\nwhile :; do sleep 0.05; done\n")
    stubborn.chmod(0o755)
    b = LocalBackend("m", "tcp://x", None, log_dir=str(tmp_path), python=str(stubborn), id_prefix="t",
                     kill_after_s=0.3)
    try:
        b.scale("encode", 0, 2)
        up(tmp_path, b)
        first, second = sorted(b.procs)
        os.killpg(b.procs[first].popen.pid, signal.SIGKILL)  # a crash, not a drain
        b.scale("encode", 2, 1)  # drains the newest: `second`, which ignores SIGTERM
        events: list[str] = []
        wait_for(lambda: events.extend(b.poll()) or len(events) >= 3)
        assert any(e.startswith(f"{first} exited unexpectedly (code -9)") for e in events)
        assert any(e.startswith(f"{second} still draining 0.3s after SIGTERM: killed") for e in events)
        assert any(e.startswith(f"{second} drained and exited") for e in events)
    finally:
        b.close(timeout_s=1)


def test_local_backend_dry_run_starts_nothing(tmp_path):
    b = LocalBackend("m", "tcp://x", None, log_dir=str(tmp_path), dry_run=True)
    assert b.scale("prefill", 1, 2) == "(dry run) would start 1 prefill worker(s)"
    assert b.replicas(snap(prefill=["p0"]))["prefill"] == 2 and not b.procs


# -- the command line ----------------------------------------------------------------------------------------

def parse(*argv: str):
    from mserve.cli import build_parser

    return build_parser().parse_args(["autoscale", *argv])


def test_cli_flags_build_the_policy():
    from mserve.autoscale.cli import build_config

    cfg = build_config(parse("--min", "encode=0", "--encode-idle", "30", "--max", "4", "--max", "decode=6",
                             "--scale-up-at", "decode=10", "--scale-down-at", "decode=3", "--up-cooldown", "5",
                             "--slo-ttft", "1.5", "--slo-target", "0.95"))
    enc, pre, dec = (cfg.pools[p] for p in ("encode", "prefill", "decode"))
    assert (enc.min_replicas, enc.max_replicas, enc.idle_to_zero_s) == (0, 4, 30.0)
    assert (pre.min_replicas, pre.max_replicas, pre.up_cooldown_s, pre.down_cooldown_s) == (1, 4, 5.0, 120.0)
    assert (dec.max_replicas, dec.scale_up_at, dec.scale_down_at, dec.kv_up_at) == (6, 10.0, 3.0, 0.85)
    assert (cfg.slo.ttft_s, cfg.slo.tpot_s, cfg.slo.target) == (1.5, None, 0.95)
    assert build_config(parse("--min", "9")).pools["decode"].max_replicas == 9  # max follows a larger min
    with pytest.raises(SystemExit, match="unknown pool 'vision'"):
        build_config(parse("--min", "vision=1"))
    with pytest.raises(SystemExit, match="hysteresis"):
        build_config(parse("--scale-up-at", "1", "--scale-down-at", "2"))


def test_cli_help_explains(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for words in ("from-zero", "--encode-idle", "drains", "kubectl scale deployment/mserve-POOL", "--dry-run",
                  "docker compose up -d --no-recreate"):
        assert words in out
