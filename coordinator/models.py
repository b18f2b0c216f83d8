"""The models one coordinator serves, each with its own pools, queues, caches and KV accounting, found by name.

Every served model is a ServedModel: its name (the workers' --model-name), its checkpoint folder, the
PromptBuilder admission tokenizes with, and its own RequestMachine (coordinator/requests.py), so one
model's workers, stage queues, shedding and KV blocks never see another's requests: killing,
draining or flooding one model leaves the others as they were. A model joins when its first worker
registers (its builder is loaded then, from the folder that worker names); it is served while it
has live workers. `serving_model` is the one place a request's `model` becomes the pools that serve
it: group or variant routing (a name that stands for several models) belongs there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from mserve.common.protocol import ErrorCode
from mserve.common.protocol.to_coordinator import WorkerInfo
from mserve.coordinator.variant_policy import GroupState, VariantGroup, VariantRule, choose_variant, variant_load

log = logging.getLogger("mserve.coordinator")


class ModelUnavailable(Exception):
    """A request's `model` names nothing served here (model_not_found), or a model that lacks a pool (no_workers)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ServedModel:
    name: str
    path: str  # the checkpoint folder its tokenizer and processor rules came from
    builder: Any  # common/prompt.PromptBuilder: admission's tokenizer for this model
    machine: Any  # coordinator/requests.RequestMachine: this model's workers and requests

    def live_roles(self) -> set[str]:
        """Roles with a live worker, draining ones included: a pool whose last worker drains (a rolling
        restart, its replacement on the way) parks new requests, as with one model; a dead one refuses them."""
        return {w.role for w in self.machine.members.views() if w.alive}


def missing_text_roles(roles: set[str]) -> list[str]:
    """The roles a text request still needs with these live ones: none when a unified worker is up."""
    return [] if "unified" in roles else [r for r in ("prefill", "decode") if r not in roles]


def served(models: Mapping[str, ServedModel], default: str | None) -> dict[str, ServedModel]:
    """The models requests may name: those with a live worker, and the coordinator's own --model."""
    return {name: m for name, m in models.items() if name == default or m.live_roles()}


def serving_model(requested: str | None, models: Mapping[str, ServedModel], default: str | None) -> ServedModel:
    """The model that serves a request asking for `requested` (None: the default, else the only one).

    Served: a model with a live worker, and the coordinator's own --model (`default`) even before its
    first worker joins (a request then waits for it, as a cold start does). A served model with live
    workers but no prefill or decode pool (and no unified one) refuses at once, naming the missing
    role; a missing encode pool only parks image requests, which an autoscaler starts from zero."""
    name = requested or default
    model = models.get(name) if name is not None else None
    roles = model.live_roles() if model is not None else set()
    if model is None or not (roles or name == default):  # the rare paths: name the served models
        live = served(models, default)
        names = ", ".join(repr(n) for n in sorted(live)) or "none (no worker has registered)"
        if name is None and len(live) == 1:
            return serving_model(next(iter(live)), models, default)
        if name is None:
            raise ModelUnavailable(ErrorCode.BAD_REQUEST, f"'model' is required: this coordinator serves {names}")
        raise ModelUnavailable(ErrorCode.MODEL_NOT_FOUND,
                               f"the model {name!r} is not served here (no live worker); served models: {names}")
    if roles and (missing := missing_text_roles(roles)):
        raise ModelUnavailable(ErrorCode.NO_WORKERS,
                               f"the model {name!r} has no live {' or '.join(missing)} worker (live roles: "
                               f"{', '.join(sorted(roles))}); its requests cannot be served until one joins")
    return model


class VariantRouter:
    """Model-version routing (--variant-groups): the decision is coordinator/variant_policy.py's, made on each
    variant's own request machine's figures; this keeps each group's state between decisions."""

    def __init__(self, groups: Mapping[str, VariantGroup], rule: VariantRule) -> None:
        self.groups, self.rule = dict(groups), rule
        self.states = {name: GroupState() for name in groups}
        self.chosen: dict[tuple[str, str], int] = {}  # (group, variant) -> requests routed there

    def live(self, group: VariantGroup, models: Mapping[str, ServedModel]) -> list[str]:
        return [v for v in group.variants if (m := models.get(v)) is not None and m.live_roles()]

    def choose(self, group: VariantGroup, latency_class: str, models: Mapping[str, ServedModel], now: float) -> str:
        loads = {v: variant_load(models[v].machine.requests.values(), models[v].machine.members.routable())
                 for v in self.live(group, models)}
        decision = choose_variant(group, latency_class, loads, self.rule, self.states[group.name], now)
        moved = decision.state.interactive != self.states[group.name].interactive
        self.states[group.name] = decision.state
        if decision.variant is None:
            raise ModelUnavailable(ErrorCode.NO_WORKERS, f"the model group {group.name!r} has no variant with live "
                                                         f"workers (variants: {', '.join(group.variants)})")
        if moved:
            log.info("variant routing: %s", decision.reason)
        key = (group.name, decision.variant)
        self.chosen[key] = self.chosen.get(key, 0) + 1
        return decision.variant


class ModelTable:
    """Served models by name, and which model each worker serves (its READY says)."""

    def __init__(self, default_name: str | None, default_path: str | None,
                 make: Callable[[str, str], ServedModel], router: VariantRouter | None = None) -> None:
        self.default = default_name
        self.router = router
        self._default_path = default_path
        self._make = make  # (name, folder) -> a new ServedModel (loads its tokenizer)
        self._models: dict[str, ServedModel] = {}
        self._model_of: dict[str, str] = {}  # worker id -> model name
        if default_name is not None and default_path is not None:
            self._models[default_name] = make(default_name, default_path)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def served_names(self) -> list[str]:
        """Served models, and the variant groups with a live variant."""
        groups = [g.name for g in self.router.groups.values() if self.router.live(g, self._models)] \
            if self.router is not None else []
        return sorted([*served(self._models, self.default), *groups])

    def groups(self) -> dict[str, list[str]]:
        """{group name: its variants, smallest first} (STATUS: the gateway reads which folder a group's tokens use)."""
        return {g.name: list(g.variants) for g in self.router.groups.values()} if self.router is not None else {}

    def serving(self, requested: str | None, latency_class: str = "interactive", now: float = 0.0) -> ServedModel:
        """The model that serves a request for `requested`: a model's name, or a group's (a variant chosen)."""
        if self.router is not None and requested in self.router.groups:
            requested = self.router.choose(self.router.groups[requested], latency_class, self._models, now)
        return serving_model(requested, self._models, self.default)

    def of_worker(self, worker_id: str) -> ServedModel | None:
        """The model a registered worker serves (None: not registered here)."""
        name = self._model_of.get(worker_id)
        return None if name is None else self._models.get(name)

    def register(self, worker_id: str, info: WorkerInfo) -> ServedModel | None:
        """The model a worker's READY (or heartbeat registration) joins, made on its first worker; None
        when its folder cannot be read here (logged: the worker gets no work)."""
        name = info.model or self.default or info.model_path
        if not name:
            log.error("worker %s names no model and this coordinator has no --model; ignored", worker_id)
            return None
        model = self._models.get(name)
        if model is None:
            path = info.model_path or (self._default_path if name == self.default else None)
            if not path:
                log.error("worker %s serves %r but names no checkpoint folder; ignored", worker_id, name)
                return None
            try:
                model = self._make(name, path)
            except Exception as exc:  # the folder is not readable here: this model cannot be admitted
                log.error("worker %s serves %r from %s, which this coordinator cannot load (%s: %s); ignored",
                          worker_id, name, path, type(exc).__name__, exc)
                return None
            self._models[name] = model
            log.info("model %r joined (checkpoint %s) with worker %s", name, path, worker_id)
        self._model_of[worker_id] = name
        return model


def merged_status(models: ModelTable, default: str | None) -> dict[str, Any]:
    """STATUS over every model: the cluster's totals at the top (as with one model, so `mserve status`, the
    gateway and the autoscaler read a one-model cluster as before), each model's own under "models".
    "model" / "model_path" name the default model (else the first that joined)."""
    # "verification": a family with tests here, or one its workers proved at load (workers/probe.py);
    # "modalities": what its requests may hold (ModelFamily.modalities)
    per = {m.name: {**m.machine.status(), "model_path": m.path,
                    "verification": "tested" if m.builder.family.tested else "verified at load",
                    "modalities": m.builder.family.modalities} for m in models}
    workers: dict[str, Any] = {}
    roles: dict[str, int] = {}
    stats: dict[str, float] = {}
    queued: dict[str, dict[str, int]] = {}
    waiting: dict[str, dict[str, Any]] = {}
    for name, st in per.items():
        workers.update({wid: {**w, "model": name} for wid, w in st.pop("workers").items()})
        for role, n in st["roles"].items():
            roles[role] = roles.get(role, 0) + n
        for key, n in st["stats"].items():
            stats[key] = stats.get(key, 0) + n
        for stage, classes in st["queued"].items():
            for cls, n in classes.items():
                queued.setdefault(stage, {})[cls] = queued.get(stage, {}).get(cls, 0) + n
        for role, w in st["waiting"].items():
            total = waiting.setdefault(role, {"requests": 0, "oldest_s": 0.0})
            total["requests"] += w["requests"]
            total["oldest_s"] = max(total["oldest_s"], w["oldest_s"])
    main = default if default in per else next(iter(per), None)
    top = dict(per[main]) if main is not None else {"telemetry": {}, "encode_parked": 0}
    return {**top, "telemetry": merged_telemetry([st["telemetry"] for st in per.values()]), "workers": workers, "roles": roles, "stats": stats, "queued": queued, "waiting": waiting,
            "requests_in_flight": sum(st["requests_in_flight"] for st in per.values()),
            "encode_parked": sum(st["encode_parked"] for st in per.values()),
            "model": main, "model_path": per[main]["model_path"] if main is not None else None, "models": per,
            "served_models": models.served_names(), "variant_groups": models.groups(),
            "variant_routed": {f"{g}/{v}": n for (g, v), n in sorted(models.router.chosen.items())}
            if models.router is not None else {}}


def merged_telemetry(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Every model's coordinator/telemetry.py snapshot summed: counters added, histograms bucket by bucket
    (all share the same bounds)."""
    if len(snapshots) == 1:
        return snapshots[0]
    counters: dict[str, float] = {}
    histograms: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        for key, n in (snap.get("counters") or {}).items():
            counters[key] = counters.get(key, 0) + n
        for key, h in (snap.get("histograms") or {}).items():
            total = histograms.setdefault(key, {"le": list(h["le"]), "counts": [0] * len(h["counts"]),
                                                "sum": 0.0, "count": 0})
            total["counts"] = [a + b for a, b in zip(total["counts"], h["counts"])]
            total["sum"] = round(total["sum"] + h["sum"], 6)
            total["count"] += h["count"]
    return {"histograms": histograms, "counters": counters}
