"""deploy/: the Kubernetes manifests against the Kubernetes JSON schemas (kubernetes-validate, offline), and
every manifest and compose file against the real `mserve` CLI and settings classes. No cluster, no Docker.

Checked: each object validates strictly (unknown fields fail) for the oldest and newest Kubernetes
versions named below, the MIG overlay too (its JSON 6902 patches applied here); every MServe
container's args parse with `mserve`'s own argparse parser and every MSERVE_* variable (env, envFrom
ConfigMaps) is a field of that command's settings class with a value it accepts; probes exist and
their `python -m mserve.healthcheck` commands parse; GPU / MIG resources sit where expected; Services
select Deployments and name ports that exist; the compose files keep scale-able pools with health
checks and the model volume. Not checked: that the images build or that a cluster runs them.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate  # the dev extra; it ships the schemas, nothing is fetched
import pytest
import yaml

from mserve import healthcheck
from mserve.cli import build_parser
from mserve.coordinator.settings import CoordinatorSettings
from mserve.gateway.settings import GatewaySettings
from mserve.workers.settings import WorkerSettings
from mserve.workers.sizing import MIG_PROFILES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
_SHIPPED = kubernetes_validate.utils.all_versions()
K8S_VERSIONS = (next((v for v in _SHIPPED if v.startswith("1.29.")), _SHIPPED[0]), _SHIPPED[-1])  # oldest, newest
POOLS = ("encode", "prefill", "decode")
SETTINGS = {"worker": WorkerSettings, "coordinator": CoordinatorSettings, "gateway": GatewaySettings}
NOT_MSERVE_ENV = {"HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "PYTHONUNBUFFERED"}
MIG_RESOURCES = {p.resource for profiles in MIG_PROFILES.values() for p in profiles}


# --------------------------------------------------------------------------- rendering (kustomize's part we use)


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(doc: Any, path: str) -> tuple[Any, str | int]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for p in parts[:-1]:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    last = parts[-1]
    return doc, (int(last) if isinstance(doc, list) and last != "-" else last)


def json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add / replace / remove, the ops our overlays use; a path that does not exist fails."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        if op["op"] == "replace":
            parent[key]  # KeyError / IndexError: replace needs the target to exist
            parent[key] = op["value"]
        elif op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if key == "-" else key, op["value"])
            else:
                parent[key] = op["value"]
        elif op["op"] == "remove":
            del parent[key]
        else:
            raise AssertionError(f"op {op['op']!r} not handled by this test")
    return doc


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` yields, for what our kustomizations use (resources, patches)."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert set(kust) <= {"apiVersion", "kind", "resources", "patches", "labels", "images"}, set(kust)
    docs: list[dict[str, Any]] = []
    for res in kust["resources"]:
        path = folder / res
        docs += render(path) if path.is_dir() else _load(path)
    for patch in kust.get("patches", []):
        target, ops = patch["target"], yaml.safe_load((folder / patch["path"]).read_text())
        assert isinstance(ops, list), "only JSON 6902 patches are applied here"
        hits = [i for i, d in enumerate(docs)
                if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} objects"
        docs[hits[0]] = json6902(docs[hits[0]], ops)
    return docs


def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}


def mserve_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for dep in deployments(docs).values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0] == "mserve":
                yield dep, c


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def mig() -> list[dict[str, Any]]:
    return render(K8S / "mig")


# --------------------------------------------------------------------------- checks, usable on bad input too


def schema_errors(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}"
    return None


def cli_errors(argv: list[str]) -> str | None:
    """argparse's own verdict on an `mserve ...` command line (it exits 2 on an unknown flag or choice)."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        return f"`mserve {shlex.join(argv)}` does not parse (exit {exc.code})"
    return None


def env_errors(command: str, env: dict[str, str]) -> list[str]:
    """Each MSERVE_* name must be a field of the command's settings class, and its value one the class takes."""
    cls, errors, given = SETTINGS[command], [], {}
    for name, value in env.items():
        if not name.startswith("MSERVE_"):
            if name not in NOT_MSERVE_ENV:
                errors.append(f"{name}: not an MServe setting")
            continue
        field = name.removeprefix("MSERVE_").lower()
        if field not in cls.model_fields:
            errors.append(f"{name}: {cls.__name__} has no field {field!r}")
        elif value is not None:
            given[field] = value
    if not errors:
        required = {"role": "decode", "model": "/models/m"} if cls is WorkerSettings else (
            {"model": "/models/m"} if cls is CoordinatorSettings else {})
        try:
            cls(**{**required, **given})
        except Exception as exc:  # pydantic's ValidationError names the field and the value
            errors.append(f"{cls.__name__}: {exc}")
    return errors


def container_env(c: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str | None]:
    """The container's variables (None where the value comes from the downward API or a Secret)."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str | None] = {}
    for ref in c.get("envFrom", []):
        name = ref["configMapRef"]["name"]
        assert name in maps, f"envFrom ConfigMap {name} is not in the manifests"
        env.update(maps[name])
    for e in c.get("env", []):
        key_ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if key_ref:
            assert key_ref["key"] in maps.get(key_ref["name"], {}), f"{e['name']}: no {key_ref}"
            env[e["name"]] = maps[key_ref["name"]][key_ref["key"]]
        else:
            env[e["name"]] = e.get("value")
    return env


def probe_errors(probe: dict[str, Any]) -> str | None:
    cmd = probe.get("exec", {}).get("command")
    if cmd and cmd[:3] == ["python", "-m", "mserve.healthcheck"]:
        try:
            healthcheck.build_parser().parse_args(cmd[3:])
        except SystemExit:
            return f"{shlex.join(cmd)} does not parse"
    return None


# --------------------------------------------------------------------------- the Kubernetes manifests


def test_every_file_is_in_its_kustomization():
    for folder in (K8S / "base", K8S / "mig"):
        kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
        listed = set(kust.get("resources", [])) | {p["path"] for p in kust.get("patches", [])}
        on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert on_disk == {r for r in listed if not r.startswith("..")}, folder


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_base_validates_against_the_kubernetes_schemas(base, version):
    assert len(base) >= 10
    errors = [e for d in base if (e := schema_errors(d, version))]
    assert not errors, "\n".join(errors)


def test_mig_overlay_validates_against_the_kubernetes_schemas(mig):
    errors = [e for d in mig if (e := schema_errors(d, K8S_VERSIONS[-1]))]
    assert not errors, "\n".join(errors)


def test_the_validator_catches_mistakes(base):
    dep = copy.deepcopy(deployments(base)["mserve-decode"])
    dep["spec"]["replica"] = 2  # a typo: strict schemas refuse unknown fields
    assert "replica" in (schema_errors(dep, K8S_VERSIONS[-1]) or "")
    dep = copy.deepcopy(deployments(base)["mserve-decode"])
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = "often"
    assert schema_errors(dep, K8S_VERSIONS[-1])


def test_a_deployment_per_pool_with_its_labels(base):
    deps = deployments(base)
    for role in POOLS:
        dep = deps[f"mserve-{role}"]
        labels = {"app.kubernetes.io/name": "mserve", "app.kubernetes.io/component": role}
        assert labels.items() <= dep["metadata"]["labels"].items()
        assert dep["spec"]["selector"]["matchLabels"] == labels
        assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert {"mserve-redis", "mserve-coordinator", "mserve-gateway"} <= set(deps)
    assert deps["mserve-coordinator"]["spec"]["replicas"] == 1  # one router of requests


@pytest.mark.parametrize("overlay", ["base", "mig"])
def test_args_and_env_are_real_flags_and_settings(overlay, request):
    docs = request.getfixturevalue(overlay)
    seen = set()
    for dep, c in mserve_containers(docs):
        command = c["args"][0]
        seen.add(command)
        assert (err := cli_errors(c["args"])) is None, f"{dep['metadata']['name']}: {err}"
        errs = env_errors(command, container_env(c, docs))
        assert not errs, f"{dep['metadata']['name']}: {errs}"
    assert seen == {"worker", "coordinator", "gateway"}


def test_the_flag_and_setting_checks_can_fail():
    assert cli_errors(["worker", "--role", "decode", "--num-blockz", "3"])
    assert cli_errors(["worker", "--role", "embed"])
    assert not cli_errors(["worker", "--role", "decode", "--gpu-memory-fraction", "0.5"])
    assert env_errors("worker", {"MSERVE_NUM_BLOCKZ": "3"})
    assert env_errors("worker", {"MSERVE_TRANSFER": "carrier-pigeon"})  # not one of the Literal's values
    assert env_errors("gateway", {"MSERVE_REDIS": "redis://r"})  # a worker setting, not the gateway's
    assert env_errors("worker", {"CUDA_VISIBLE_DEVICE": "0"})
    assert not env_errors("worker", {"MSERVE_GPU_MEMORY_FRACTION": "0.9", "MSERVE_TRANSFER": "auto"})


def test_probes_everywhere(base):
    for name, dep in deployments(base).items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for kind in ("readinessProbe", "livenessProbe"):
                assert kind in c, f"{name}/{c['name']} has no {kind}"
                assert probe_errors(c[kind]) is None, f"{name}: {probe_errors(c[kind])}"
    for role in POOLS:
        c = deployments(base)[f"mserve-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert "--ready" in c["startupProbe"]["exec"]["command"] and "--ready" in c["readinessProbe"]["exec"]["command"]
        assert "--ready" not in c["livenessProbe"]["exec"]["command"]  # liveness must not hang on the coordinator
    assert probe_errors({"exec": {"command": ["python", "-m", "mserve.healthcheck", "worker", "--redy"]}})


def test_grace_periods_outlast_a_workers_drain(base):
    drain = WorkerSettings.model_fields.get("drain_timeout_s")  # SIGTERM: drain, then exit
    limit = drain.default if drain is not None else 0
    for role in POOLS:
        assert deployments(base)[f"mserve-{role}"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > limit
        assert int(_compose("docker-compose.yml")["services"][role]["stop_grace_period"].rstrip("s")) > limit


def _resources(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dep["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_gpu_requests(base, mig):
    for docs, kind in ((base, "gpu"), (mig, "mig")):
        deps = deployments(docs)
        for name, dep in deps.items():
            res = _resources(dep)
            assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"]), name
            gpus = {k for k in res["limits"] if k.startswith("nvidia.com/")}
            if name.removeprefix("mserve-") not in POOLS:
                assert not gpus, f"{name} asks for {gpus}"
                continue
            # Extended resources: the request must equal the limit.
            assert {k: res["requests"].get(k) for k in gpus} == {k: res["limits"][k] for k in gpus}, name
            if kind == "gpu":
                assert gpus == {"nvidia.com/gpu"} and res["limits"]["nvidia.com/gpu"] == 1, name
            else:
                assert len(gpus) == 1 and gpus <= MIG_RESOURCES, f"{name}: {gpus} is not a known MIG profile"


def test_workers_advertise_their_pod_ip_and_mount_the_models(base):
    pvcs = {d["metadata"]["name"] for d in base if d["kind"] == "PersistentVolumeClaim"}
    for dep, c in mserve_containers(base):
        spec = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        assert "/models" in mounts and mounts["/models"].get("readOnly"), dep["metadata"]["name"]
        claim = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"]
        assert claim in pvcs
        env = {e["name"]: e for e in c.get("env", [])}
        if c["args"][0] == "worker":
            assert env["MSERVE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["MSERVE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert "/dev/shm" in mounts
    model = next(d for d in base if d["kind"] == "ConfigMap")["data"]["MSERVE_MODEL"]
    assert model.startswith("/models/")


def test_services_select_deployments_and_ports(base):
    deps = deployments(base)
    for svc in (d for d in base if d["kind"] == "Service"):
        matches = [d for d in deps.values()
                   if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, svc["metadata"]["name"]
        ports = {p["name"] for c in matches[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    names = {d["metadata"]["name"] for d in base if d["kind"] == "Service"}
    assert {"mserve-redis", "mserve-coordinator", "mserve-gateway"} <= names
    # What the processes dial is what the Services offer.
    config = next(d for d in base if d["kind"] == "ConfigMap")["data"]
    assert config["MSERVE_REDIS"].startswith("redis://mserve-redis:6379")
    for dep, c in mserve_containers(base):
        if c["args"][0] in ("worker", "gateway"):
            addr = c["args"][c["args"].index("--coordinator") + 1]
            port = 5556 if c["args"][0] == "worker" else 5555  # workers' socket, clients' socket
            assert addr == f"tcp://mserve-coordinator:{port}"


# --------------------------------------------------------------------------- compose


def _compose(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def _service_command(svc: dict[str, Any]) -> list[str]:
    """`mserve ...` argv of a compose service: its command, or what its `sh -c` entrypoint execs."""
    if "entrypoint" in svc:
        script = svc["entrypoint"][-1]
        return shlex.split(script.split("exec mserve", 1)[1])
    return list(svc["command"])


def test_compose_pools_scale_and_have_health_checks():
    compose = _compose("docker-compose.yml")
    services = compose["services"]
    assert {"redis", "coordinator", "gateway", *POOLS} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc and svc["healthcheck"]["test"], f"{name} has no health check"
        test = svc["healthcheck"]["test"]
        argv = shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:]
        if argv[:3] == ["python", "-m", "mserve.healthcheck"]:
            argv = [a.replace("$$(hostname)", "h") for a in argv]
            healthcheck.build_parser().parse_args(argv[3:])
    for role in POOLS:
        svc = services[role]
        assert "container_name" not in svc and "ports" not in svc, f"{role} could not be --scale'd"
        assert any(v.endswith(":/models:ro") for v in svc["volumes"]), role
        assert "$$(hostname -i)" in svc["entrypoint"][-1]  # each replica advertises its own address
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"


def test_compose_commands_and_env_are_real():
    services = _compose("docker-compose.yml")["services"]
    for name, svc in services.items():
        if name == "redis":
            continue
        argv = _service_command(svc)
        assert cli_errors(argv) is None, f"{name}: {cli_errors(argv)}"
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        env = {k: ("/models/m" if "${" in v else v) for k, v in env.items()}  # ${MSERVE_MODEL:-...}
        assert not env_errors(argv[0], env), f"{name}: {env_errors(argv[0], env)}"
    cuda = _compose("docker-compose.cuda.yml")["services"]
    assert set(cuda) <= set(services)
    total = 0.0
    for role in POOLS:
        env = cuda[role]["environment"]
        assert not env_errors("worker", env), env_errors("worker", env)
        total += float(env["MSERVE_GPU_MEMORY_FRACTION"])
        assert cuda[role]["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        assert cuda[role]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert total <= 1.0  # one replica of each pool shares GPU 0


def test_dockerfiles():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / name).read_text()
        assert 'ENTRYPOINT ["mserve"]' in text
        for line in text.splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (DEPLOY.parent / src).exists(), f"{name}: COPY {src}: no such path"
    cuda = (DEPLOY / "Dockerfile.cuda").read_text()
    assert "whl/cu" in cuda and "torch.version.cuda" in cuda
    env = dict(re.findall(r"\b(MSERVE_\w+)=(\S+)", cuda))
    assert env and not env_errors("worker", env)
