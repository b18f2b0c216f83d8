"""deploy/: the Kubernetes manifests against the Kubernetes JSON schemas (kubernetes-validate, offline), and
every manifest and compose file against the real `mserve` CLI and settings classes. No cluster, no Docker.

Checked: each object validates strictly (unknown fields fail) for the oldest and newest Kubernetes
versions named below, the MIG and sharded overlays too (their patches applied here: JSON 6902, and
strategic-merge `$patch: delete`); every MServe container's args parse with `mserve`'s own argparse
parser (after the $(VAR) expansion Kubernetes does, from the container's env) and every MSERVE_*
variable (env, envFrom ConfigMaps) is a field of that command's settings class with a value it
accepts; probes exist and their `python -m mserve.healthcheck` commands parse; GPU / MIG resources sit
where expected; Services select Deployments and name ports that exist; the sharded overlay runs its
coordinator as one StatefulSet of shards that workers and the gateway find in Redis; the compose
files keep scale-able pools with health checks and the model volume. Where `kubectl` (or `kustomize`)
is installed, it renders each folder too and must agree with this file's rendering. Not checked: that
the images build or that a cluster runs them.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
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
from mserve.workers.mig import MIG_PROFILES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
_SHIPPED = kubernetes_validate.utils.all_versions()
K8S_VERSIONS = (next((v for v in _SHIPPED if v.startswith("1.29.")), _SHIPPED[0]), _SHIPPED[-1])  # oldest, newest
POOLS = ("encode", "prefill", "decode")
SETTINGS = {"worker": WorkerSettings, "coordinator": CoordinatorSettings, "gateway": GatewaySettings}
NOT_MSERVE_ENV = {"HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "PYTHONUNBUFFERED"}
MIG_RESOURCES = {p.resource for profiles in MIG_PROFILES.values() for p in profiles}
OVERLAYS = ("base", "mig", "sharded")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# What the downward API gives a pod, for expanding $(VAR) in args: a plausible value per fieldPath.
DOWNWARD_API = {"metadata.name": "{workload}-0", "metadata.namespace": "mserve", "status.podIP": "10.42.0.7",
                "spec.nodeName": "gpu-node-1"}


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
    """RFC 6902 add / replace / remove / test, the ops our overlays use; a path that does not exist fails."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        if op["op"] == "test":
            assert parent[key] == op["value"], f"test {op['path']}: {parent[key]!r} != {op['value']!r}"
        elif op["op"] == "replace":
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


def _matches(docs: list[dict[str, Any]], kind: str, name: str) -> int:
    hits = [i for i, d in enumerate(docs) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"patch target {kind}/{name} matches {len(hits)} objects"
    return hits[0]


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` yields, for what our kustomizations use: resources, JSON 6902
    patches (a file, with a target) and strategic-merge patches that delete an object (`$patch: delete`)."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert set(kust) <= {"apiVersion", "kind", "resources", "patches", "labels", "images"}, set(kust)
    docs: list[dict[str, Any]] = []
    for res in kust["resources"]:
        path = folder / res
        docs += render(path) if path.is_dir() else _load(path)
    for patch in kust.get("patches", []):
        body = yaml.safe_load(patch["patch"] if "patch" in patch else (folder / patch["path"]).read_text())
        if isinstance(body, list):  # JSON 6902: needs its target
            target = patch["target"]
            i = _matches(docs, target["kind"], target["name"])
            docs[i] = json6902(docs[i], body)
        else:  # strategic merge: only deletion is applied here
            assert body.get("$patch") == "delete", f"strategic-merge patch not handled by this test: {body}"
            assert set(body) == {"$patch", "apiVersion", "kind", "metadata"}, body
            i = _matches(docs, body["kind"], body["metadata"]["name"])
            assert docs[i]["apiVersion"] == body["apiVersion"], body
            del docs[i]
    return docs


def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deployments and StatefulSets (the sharded overlay's coordinator)."""
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def mserve_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for dep in workloads(docs):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0] == "mserve":
                yield dep, c


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argv."""
    assert name in args, f"{name} not in {args}"
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def mig() -> list[dict[str, Any]]:
    return render(K8S / "mig")


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, Any]]:
    return render(K8S / "sharded")


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


def env_errors(command: str, env: dict[str, str], helpers: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Each MSERVE_* name must be a field of the command's settings class, and its value one the class takes.
    `helpers`: other names allowed, the variables the args expand ($(POD_IP))."""
    cls, errors, given = SETTINGS[command], [], {}
    for name, value in env.items():
        if not name.startswith("MSERVE_"):
            if name not in NOT_MSERVE_ENV | set(helpers):
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


_VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # $(NAME), not the escaped $$(NAME)


def arg_vars(c: dict[str, Any]) -> set[str]:
    """The variables a container's args reference as $(NAME)."""
    return {m for a in c.get("args", []) for m in _VAR_REF.findall(a)}


def expand_args(c: dict[str, Any], workload: dict[str, Any], docs: list[dict[str, Any]]) -> list[str]:
    """The args as the kubelet passes them: each $(NAME) replaced by the container's variable, downward API
    fields by a plausible value (DOWNWARD_API). A reference to no variable fails: Kubernetes would leave
    it in the argument as it is."""
    plain = container_env(c, docs)
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c.get("env", [])
              if "fieldRef" in e.get("valueFrom", {})}

    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in fields:
            assert fields[name] in DOWNWARD_API, f"$({name}): no example value for {fields[name]}"
            return DOWNWARD_API[fields[name]].format(workload=workload["metadata"]["name"])
        assert plain.get(name) is not None, f"{workload['metadata']['name']}: $({name}) is not in the container's env"
        return str(plain[name])

    return [_VAR_REF.sub(value, a).replace("$$(", "$(") for a in c.get("args", [])]


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
    assert {p.name for p in K8S.iterdir() if p.is_dir()} == set(OVERLAYS)  # a new folder: add it to the tests
    for folder in (K8S / name for name in OVERLAYS):
        kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
        listed = set(kust.get("resources", [])) | {p["path"] for p in kust.get("patches", []) if "path" in p}
        on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert on_disk == {r for r in listed if not r.startswith("..")}, folder
        for path in on_disk:  # each file says what it is for
            assert (folder / path).read_text().startswith("# "), f"{folder.name}/{path}: no comment at the top"


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """An object without what this file's rendering skips: the `labels` and `images` transformers' work."""
    doc = copy.deepcopy(doc)
    doc["metadata"].get("labels", {}).pop("app.kubernetes.io/part-of", None)
    for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        c["image"] = c["image"].split(":")[0]
    return doc


@pytest.mark.skipif(_kustomize() is None, reason="neither kustomize nor kubectl is installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_renders_what_this_test_renders(overlay):
    out = subprocess.run([*_kustomize(), str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in theirs:  # the transformers ran there
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "mserve", d["metadata"]["name"]
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["image"] != "mserve", f"{d['metadata']['name']}: the images transformer missed it"

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    ours = render(K8S / overlay)
    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    by_key = {key(d): _comparable(d) for d in theirs}
    for d in ours:
        assert _comparable(d) == by_key[key(d)], key(d)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_base_validates_against_the_kubernetes_schemas(base, version):
    assert len(base) >= 10
    errors = [e for d in base if (e := schema_errors(d, version))]
    assert not errors, "\n".join(errors)


def test_mig_overlay_validates_against_the_kubernetes_schemas(mig):
    errors = [e for d in mig if (e := schema_errors(d, K8S_VERSIONS[-1]))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_sharded_overlay_validates_against_the_kubernetes_schemas(sharded, version):
    assert any(d["kind"] == "StatefulSet" for d in sharded)
    errors = [e for d in sharded if (e := schema_errors(d, version))]
    assert not errors, "\n".join(errors)


def test_the_rendering_can_fail(base, tmp_path):
    dep = deployments(base)["mserve-decode"]
    with pytest.raises(AssertionError):  # a JSON 6902 test op that does not hold stops the patch
        json6902(dep, [{"op": "test", "path": "/spec/template/spec/containers/0/args/0", "value": "gateway"}])
    assert json6902(dep, [{"op": "test", "path": "/spec/template/spec/containers/0/args/0", "value": "worker"}]) == dep
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [str(K8S / "base")],
        "patches": [{"patch": "$patch: delete\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: mserve-nope}"}]}))
    with pytest.raises(AssertionError, match="matches 0 objects"):
        render(tmp_path)


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_args_and_env_are_real_flags_and_settings(overlay, request):
    docs = request.getfixturevalue(overlay)
    seen = set()
    for dep, c in mserve_containers(docs):
        command = c["args"][0]
        seen.add(command)
        args = expand_args(c, dep, docs)  # $(POD_IP) -> 10.42.0.7, as the kubelet would
        assert not any("$(" in a for a in args), args
        assert (err := cli_errors(args)) is None, f"{dep['metadata']['name']}: {err}"
        errs = env_errors(command, container_env(c, docs), helpers=arg_vars(c))
        assert not errs, f"{dep['metadata']['name']}: {errs}"
    assert seen == {"worker", "coordinator", "gateway"}


def test_arg_expansion():
    workload = {"metadata": {"name": "mserve-coordinator"}}
    c = {"args": ["--shard-id", "$(POD_NAME)", "--advertise", "tcp://$(POD_IP):5555", "--x", "$$(POD_IP)", "$(B)"],
         "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                 {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                 {"name": "B", "value": "b"}]}
    assert expand_args(c, workload, []) == ["--shard-id", "mserve-coordinator-0", "--advertise", "tcp://10.42.0.7:5555",
                                            "--x", "$(POD_IP)", "b"]
    assert arg_vars(c) == {"POD_NAME", "POD_IP", "B"}
    with pytest.raises(AssertionError, match="not in the container's env"):
        expand_args({"args": ["$(POD_IP)"]}, workload, [])
    assert env_errors("gateway", {"POD_IP": None}) and not env_errors("gateway", {"POD_IP": None}, helpers={"POD_IP"})


def test_the_flag_and_setting_checks_can_fail():
    assert cli_errors(["worker", "--role", "decode", "--num-blockz", "3"])
    assert cli_errors(["worker", "--role", "embed"])
    assert not cli_errors(["worker", "--role", "decode", "--gpu-memory-fraction", "0.5"])
    assert env_errors("worker", {"MSERVE_NUM_BLOCKZ": "3"})
    assert env_errors("worker", {"MSERVE_TRANSFER": "carrier-pigeon"})  # not one of the Literal's values
    assert env_errors("gateway", {"MSERVE_REDIS": "redis://r"})  # a worker setting, not the gateway's
    assert env_errors("worker", {"CUDA_VISIBLE_DEVICE": "0"})
    assert not env_errors("worker", {"MSERVE_GPU_MEMORY_FRACTION": "0.9", "MSERVE_TRANSFER": "auto"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_everywhere(overlay, request):
    docs = request.getfixturevalue(overlay)
    for dep in workloads(docs):
        name = dep["metadata"]["name"]
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for kind in ("readinessProbe", "livenessProbe"):
                assert kind in c, f"{name}/{c['name']} has no {kind}"
                assert probe_errors(c[kind]) is None, f"{name}: {probe_errors(c[kind])}"
    for role in POOLS:
        c = deployments(docs)[f"mserve-{role}"]["spec"]["template"]["spec"]["containers"][0]
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


def test_sharded_overlay_runs_the_coordinator_as_shards_found_in_redis(sharded):
    from mserve.common.shards import advertised, is_redis_url

    redis_url = next(d for d in sharded if d["kind"] == "ConfigMap")["data"]["MSERVE_REDIS"]
    coordinators = [(w, c) for w, c in mserve_containers(sharded) if c["args"][0] == "coordinator"]
    assert len(coordinators) == 1, [w["metadata"]["name"] for w, _ in coordinators]  # the base's Deployment went
    sts, c = coordinators[0]
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] >= 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    args = expand_args(c, sts, sharded)
    assert flag(args, "--redis") == redis_url
    # Each shard is named after its pod and announces its pod IP (it binds a wildcard).
    assert flag(args, "--shard-id") == f"{sts['metadata']['name']}-0"
    assert advertised(flag(args, "--bind"), flag(args, "--advertise"), "client") == "tcp://10.42.0.7:5555"
    assert advertised(flag(args, "--worker-bind"), flag(args, "--worker-advertise"), "workers") == "tcp://10.42.0.7:5556"
    assert int(flag(args, "--route-choices")) >= 2 and float(flag(args, "--load-poll-s")) == 0
    report_every = int(flag(args, "--token-report-every"))
    # Its probes ask its own shard, not one the registry picks.
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert flag(c[kind]["exec"]["command"], "--coordinator") == "tcp://127.0.0.1:5555", kind
    # The StatefulSet's governing Service: headless, selecting the shards.
    svc = next(d for d in sharded if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()

    roles = set()
    for dep, c in mserve_containers(sharded):
        args = expand_args(c, dep, sharded)
        if args[0] == "worker":
            roles.add(flag(args, "--role"))
            assert is_redis_url(flag(args, "--coordinator")) and flag(args, "--coordinator") == redis_url
            assert float(flag(args, "--heartbeat-s")) >= 1
            ready = [c[k]["exec"]["command"] for k in ("startupProbe", "readinessProbe")]
            assert all(flag(cmd, "--coordinator") == redis_url for cmd in ready), ready
        elif args[0] == "gateway":
            assert flag(args, "--coordinator") == redis_url
            assert "--direct-tokens" in args and report_every > 1  # direct tokens only pay with sparse reports
            assert flag(args, "--tokens-host") == "10.42.0.7"  # the pod IP: workers dial it
    assert roles == set(POOLS)
    # Nothing dials the single coordinator's Service any more.
    text = yaml.safe_dump_all(sharded)
    assert "mserve-coordinator:" not in text and not any(
        d["kind"] == "Service" and d["metadata"]["name"] == "mserve-coordinator" for d in sharded)


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
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))  # a COPY source may be an ARG's default
        for line in text.splitlines():
            if line.startswith("COPY ") and "--from=" not in line:  # --from: a path in an earlier stage
                for src in line.split()[1:-1]:
                    src = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], src)
                    assert (DEPLOY.parent / src).exists(), f"{name}: COPY {src}: no such path"
    offline = (DEPLOY / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in offline and "--no-index --find-links" in offline
    cuda = (DEPLOY / "Dockerfile.cuda").read_text()
    assert "whl/cu" in cuda and "torch.version.cuda" in cuda
    env = dict(re.findall(r"\b(MSERVE_\w+)=(\S+)", cuda))
    assert env and not env_errors("worker", env)
