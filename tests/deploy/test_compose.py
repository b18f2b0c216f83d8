"""deploy/docker-compose.yml with real containers: Redis + coordinator + gateway + one pool of each role on
the tiny model, through the official `openai` client. Run by `make test-deploy` only (tests/deploy/conftest.py):
it needs a Docker engine and the offline images (`make image-offline`: MSERVE_IMAGE, REDIS_IMAGE).

Checked: greedy token ids through the gateway equal Hugging Face generate(do_sample=False) on the same
checkpoint; `--scale decode=2` under running streams adds a replica that registers and takes work;
`docker kill` of a decode container mid-stream ends every accepted request exactly once, tokens intact;
`mserve autoscale --backend compose` grows decode under a load step and shrinks it through a drain, nothing
lost or re-run; the `monitoring` profile's Prometheus finds the gateway's target up and reads the cluster's
counters; `docker-compose down -v` leaves no container, network or volume of the project.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from mserve.common.prompt import PromptBuilder
from mserve.coordinator.client import Client
from tests.helpers import hf_generate, make_image

pytestmark = pytest.mark.deploy
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
POOLS = {"encode": 1, "prefill": 1, "decode": 1}
LONG = 96  # tokens per load-step stream: long enough to be mid-stream when a replica comes or goes
TEXTS = ["Count the colours you know.", "Write a list of ten animals, one per line.", "What is a tensor?",
         "Say something about the sea, at length.", "Name the planets in order, then describe each."]


def _log(msg: str) -> None:
    print(f"deploy-test: {msg}", file=sys.stderr, flush=True)


def _compose_cli() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("no compose implementation (docker-compose or the docker compose plugin); run deploy/offline.sh tools")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if got := pred():
                return got
        except Exception:  # not up yet: a refused connection or a timeout reads as "not yet"
            pass
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Deployment:
    """One compose project (its own name, free host ports, the tiny model mounted) and what the tests ask it."""

    def __init__(self, models_dir: Path) -> None:
        self.project = f"mservetest{os.getpid()}"
        self.coordinator_port, self.gateway_port = _free_port(), _free_port()
        self.cli = _compose_cli()
        self.env = {**os.environ, "MODELS_DIR": str(models_dir), "MSERVE_MODEL": "/models/tiny-llava",
                    "MSERVE_IMAGE": os.environ.get("MSERVE_IMAGE", "mserve:offline"),
                    "REDIS_IMAGE": os.environ.get("REDIS_IMAGE", "mserve-redis:bookworm"),
                    "MSERVE_COORDINATOR_PORT": str(self.coordinator_port),
                    "MSERVE_GATEWAY_PORT": str(self.gateway_port),
                    # docker-compose 1.29 gives up on the engine after 60 s by default; on the test's vfs
                    # storage driver, removing five containers (each a full copy of the image) at once
                    # took longer than that on a slow disk, and `down` failed though it finished.
                    "COMPOSE_HTTP_TIMEOUT": os.environ.get("COMPOSE_HTTP_TIMEOUT", "600")}
        self.url = f"http://127.0.0.1:{self.gateway_port}"

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        cmd = [*self.cli, "-p", self.project, "-f", str(DEPLOY / "docker-compose.yml"), *args]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert out.returncode == 0, f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def up(self, **scale: int) -> None:
        flags = [a for role, n in {**POOLS, **scale}.items() for a in ("--scale", f"{role}={n}")]
        self.compose("up", "-d", "--no-build", "--no-recreate", *flags)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def status(self) -> dict[str, Any]:
        with Client(f"tcp://127.0.0.1:{self.coordinator_port}", timeout_s=5) as c:
            return c.status()

    def alive(self, role: str) -> dict[str, dict]:
        return {w: s for w, s in self.status()["workers"].items() if s["role"] == role and s["alive"]}

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: subprocess.run(["docker", *cmd, "--filter", label, "-q"], capture_output=True, text=True,
                                     check=True).stdout.split()
                for kind, cmd in {"containers": ["ps", "-a"], "networks": ["network", "ls"],
                                  "volumes": ["volume", "ls"]}.items()}

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "40", timeout_s=60)
        except Exception as e:  # the logs are for a failure report; their own failure must not hide it
            return f"(no logs: {e})"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    from mserve.common.tiny_model import make_tiny_model

    models = tmp_path_factory.mktemp("models")
    make_tiny_model(models / "tiny-llava", "llava", "tiny", seed=0)
    models.chmod(0o755)
    dep = Deployment(models)
    t0 = time.monotonic()
    try:
        dep.up()
        _wait(lambda: httpx.get(dep.url + "/health", timeout=5).status_code == 200, 600, "the gateway's /health")
    except BaseException:
        _log("start-up failed; the containers' last log lines:\n" + dep.logs())
        dep.compose("down", "-v", "--remove-orphans", "--timeout", "10")
        raise
    _log(f"compose up to a serving gateway: {time.monotonic() - t0:.0f} s")
    dep.models_dir = models / "tiny-llava"
    try:
        yield dep
    finally:
        dep.compose("down", "-v", "--remove-orphans", "--timeout", "10")


@pytest.fixture(scope="module")
def client(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def _oracle(model_dir: Path, raw: list[dict], max_tokens: int) -> list[int]:
    prompt = PromptBuilder(str(model_dir)).prepare(raw)
    return hf_generate(str(model_dir), prompt.prompt_ids, prompt.images, max_tokens, ignore_eos=True)


def _stream(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int,
            on_token: Callable[[], None] = lambda: None) -> tuple[list[int], list[str]]:
    """(token ids, finish reasons) of one streamed chat completion."""
    ids, finals = [], []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True}):
        for choice in chunk.choices:
            ids += choice.token_ids or []
            if choice.finish_reason:
                finals.append(choice.finish_reason)
        if ids:
            on_token()
    return ids, finals


class Load:
    """`streams` clients each streaming the TEXTS prompts back to back until stopped; every result kept."""

    def __init__(self, client: openai.OpenAI, model: str, streams: int = 4, max_tokens: int = LONG) -> None:
        self.client, self.model, self.streams, self.max_tokens = client, model, streams, max_tokens
        self.results: list[tuple[int, list[int], list[str], str | None]] = []
        self.stop, self.flowing = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def _loop(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            idx = k % len(TEXTS)
            k += self.streams
            try:
                ids, finals = _stream(self.client, self.model, [{"role": "user", "content": TEXTS[idx]}],
                                      self.max_tokens, self.flowing.set)
                self.results.append((idx, ids, finals, None))
            except Exception as e:  # an accepted request that failed: recorded, and the test fails on it
                self.results.append((idx, [], [], repr(e)))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        _wait(self.flowing.is_set, 120, "the first streamed token")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def check(self, model_dir: Path) -> int:
        """Every request ended once (one finish reason, no error) with HF's tokens; returns how many ran."""
        want = {i: _oracle(model_dir, [{"role": "user", "content": t}], self.max_tokens) for i, t in enumerate(TEXTS)}
        errors = [(TEXTS[i], err) for i, _, _, err in self.results if err]
        assert not errors, f"requests failed: {errors[:3]}"
        for idx, ids, finals, _ in self.results:
            assert finals == ["length"], (TEXTS[idx], finals)
            assert ids == want[idx], f"{TEXTS[idx]!r}: streamed tokens differ from HF generate"
        return len(self.results)


def test_openai_client_gets_hf_exact_tokens(deployment, client, model_id):
    image = make_image(64, 48, seed=1)
    url = "data:image/png;base64," + __import__("base64").b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    raw = [{"role": "user", "content": [{"type": "image", "image": image},
                                        {"type": "text", "text": "What is in the picture?"}]}]
    want = _oracle(deployment.models_dir, raw, 12)
    full = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert full.choices[0].token_ids == want, "greedy tokens through the gateway differ from HF generate"
    assert full.choices[0].finish_reason == "length"
    assert _stream(client, model_id, messages, 12) == (want, ["length"])


def test_scale_decode_under_load_registers_and_takes_work(deployment, client, model_id):
    before = set(deployment.alive("decode"))
    assert len(before) == 1
    t0 = time.monotonic()
    with Load(client, model_id) as load:
        deployment.up(decode=2)
        assert len(deployment.containers("decode")) == 2
        new = _wait(lambda: set(deployment.alive("decode")) - before, 600, "the second decode replica to register")
        _log(f"--scale decode=2: the new replica registered after {time.monotonic() - t0:.0f} s")
        (new_id,) = new
        _wait(lambda: deployment.alive("decode")[new_id]["counters"].get("decode_tokens", 0) > 0, 120,
              f"{new_id} to decode tokens")
    _log(f"scale step: {load.check(deployment.models_dir)} streams, all HF-exact")


def test_docker_kill_of_a_decode_container_mid_stream_loses_nothing(deployment, client, model_id):
    if len(deployment.alive("decode")) < 2:  # this test alone: start the second replica first
        deployment.up(decode=2)
        _wait(lambda: len(deployment.alive("decode")) == 2, 600, "two decode replicas")
    reruns_before = deployment.status()["stats"]["reruns"]
    with Load(client, model_id, streams=6) as load:
        busy = _wait(lambda: [w for w, s in deployment.alive("decode").items() if s["load"]["running"] > 0],
                     60, "a decode replica with requests in flight", every_s=0.2)
        victim = next(c for c in deployment.containers("decode")
                      if busy[0].endswith(subprocess.run(["docker", "inspect", "-f", "{{.Config.Hostname}}", c],
                                                         capture_output=True, text=True, check=True).stdout.strip()))
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
        _log(f"docker kill {victim[:12]} ({busy[0]}) mid-stream")
        # Its requests are re-run on the surviving replica once the coordinator finds it gone (dead_after_s).
        _wait(lambda: deployment.status()["stats"]["reruns"] > reruns_before, 120, "requests re-run after the kill")
        completed = deployment.status()["stats"]["completed"]
        _wait(lambda: deployment.status()["stats"]["completed"] >= completed + 6, 300,
              "six more requests completed on the surviving replica")
    n = load.check(deployment.models_dir)
    reruns = deployment.status()["stats"]["reruns"] - reruns_before
    _log(f"kill step: {n} streams, all HF-exact, {reruns} re-run after the kill")


def test_autoscale_compose_grows_decode_under_a_load_step_and_drains_it(deployment, client, model_id, tmp_path):
    deployment.up(decode=1)  # the tests above left two replicas
    _wait(lambda: len(deployment.alive("decode")) == 1 and len(deployment.containers("decode")) == 1, 120,
          "one decode replica")
    (before,) = deployment.alive("decode")
    reruns_before = deployment.status()["stats"]["reruns"]
    log = tmp_path / "autoscale.log"
    cmd = [sys.executable, "-m", "mserve.cli", "autoscale", "--backend", "compose",
           "--compose-command", shlex.join(deployment.cli),  # docker-compose where only compose v1 is here
           "--compose-file", str(DEPLOY / "docker-compose.yml"), "--compose-project", deployment.project,
           "--coordinator", f"tcp://127.0.0.1:{deployment.coordinator_port}", "--interval", "0.5",
           "--min", "1", "--max", "1", "--max", "decode=2",  # only decode moves
           "--scale-up-at", "decode=5.5", "--scale-down-at", "decode=4.5",
           "--up-cooldown", "0", "--down-cooldown", "1", "--down-stable", "1.5"]
    with open(log, "w") as out:
        scaler = subprocess.Popen(cmd, env=deployment.env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        with Load(client, model_id, streams=7, max_tokens=128) as step:
            new = _wait(lambda: [w for w, s in deployment.alive("decode").items()
                                 if w != before and s["counters"].get("decode_tokens", 0) > 0], 600,
                        "the autoscaler to grow decode and the new replica to serve")
            _log(f"autoscale: decode grew to 2 after {time.monotonic() - t0:.0f} s ({new[0]} serving)")
            low = Load(client, model_id, streams=4, max_tokens=192).__enter__()
        try:
            t1 = time.monotonic()
            _wait(lambda: len(deployment.containers("decode")) == 1 and len(deployment.alive("decode")) == 1, 600,
                  "the autoscaler to shrink decode back to one replica")
            _log(f"autoscale: decode drained back to 1 after {time.monotonic() - t1:.0f} s")
        finally:
            low.__exit__(None, None, None)
        assert scaler.poll() is None, f"the autoscaler exited:\n{log.read_text()[-3000:]}"
    finally:
        scaler.terminate()
        scaler.wait(timeout=60)
    n = step.check(deployment.models_dir) + low.check(deployment.models_dir)
    _log(f"autoscale step: {n} streams, all HF-exact")
    # The drained replica finished what it held: nothing lost, nothing re-run elsewhere.
    assert deployment.status()["stats"]["reruns"] == reruns_before


def test_monitoring_profile_finds_the_cluster_healthy_in_prometheus(deployment, client, model_id):
    """`--profile monitoring`'s Prometheus (Debian's, in the offline image) scrapes the gateway: its target is
    up and the cluster's request counters read through Prometheus' query API. Grafana, which Debian does not
    package, is left to a host with registry access (deploy/README.md)."""
    port = _free_port()
    deployment.env.update({"PROMETHEUS_IMAGE": os.environ.get("PROMETHEUS_IMAGE", "mserve-prometheus:bookworm"),
                           "MSERVE_PROMETHEUS_PORT": str(port)})
    prom = f"http://127.0.0.1:{port}"
    _stream(client, model_id, [{"role": "user", "content": "Say hi."}], 4)  # one completed request to read back
    try:
        deployment.compose("--profile", "monitoring", "up", "-d", "--no-build", "--no-recreate", "prometheus")

        def target_up() -> bool:
            targets = httpx.get(prom + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            return [(t["labels"]["job"], t["health"]) for t in targets] == [("mserve", "up")]

        _wait(target_up, 300, "Prometheus to scrape the gateway (target mserve up)")

        def completed() -> float:
            result = httpx.get(prom + "/api/v1/query", params={"query": "mserve_requests_completed_total"},
                               timeout=5).json()["data"]["result"]
            return float(result[0]["value"][1]) if result else 0.0

        assert _wait(completed, 120, "mserve_requests_completed_total through Prometheus") >= 1
        _log(f"monitoring: Prometheus scrapes the gateway, {completed():.0f} requests completed")
    finally:  # `down` below acts on the default profile only: the profile's container goes here
        deployment.compose("--profile", "monitoring", "rm", "-s", "-f", "-v", "prometheus")


def test_down_removes_every_container_network_and_volume(deployment):
    assert deployment.leftovers()["containers"]  # the project is up: the check below can see its objects
    deployment.compose("down", "-v", "--remove-orphans", "--timeout", "10")
    assert deployment.leftovers() == {"containers": [], "networks": [], "volumes": []}
