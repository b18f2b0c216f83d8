"""Lean clusters shared by tests in several modules: one running cluster per `Lean` spec, started by its
first user and stopped after its last one in this session's order, so a module or test run alone still
gets its own cluster, and a whole run starts each spec once instead of once per module.

A test asks for one with `@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)`
(tests/conftest.py's `shared_cluster` fixture), or a module-scoped fixture calls `SharedClusters.get` /
`release` itself with a `Lean` among its params. Each cluster has its own Redis: the `redis_url` fixture
flushes the session one before every test that asks for it. Counters accumulate across users: a test
that checks them takes `settled_counters` first and checks differences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mserve.coordinator.client import Client
from mserve.coordinator.launcher import LocalCluster


@dataclass(frozen=True)
class Lean:
    """What a shared cluster is: the family, its pools and the data-plane backend, nothing else."""

    arch: str
    encode: int = 1
    prefill: int = 1
    decode: int = 1
    unified: int = 0
    transfer: str = "auto"
    worker_args: tuple[str, ...] = ()  # every worker's extra flags (an engine setting a module's tests need)
    coordinator_args: tuple[str, ...] = ()  # the coordinator's (a routing setting)

    def __str__(self) -> str:
        pools = f"{self.unified}unified" if self.unified else f"{self.encode}e{self.prefill}p{self.decode}d"
        return f"{self.arch}-{pools}-{self.transfer}" + "".join(self.worker_args + self.coordinator_args)


LLAVA_1E1P1D = Lean("llava", transfer="shm")
QWEN2_VL_1E1P1D = Lean("qwen2_vl", transfer="tcp")
LLAVA_UNIFIED = Lean("llava", encode=0, prefill=0, decode=0, unified=1)
# Two encoders: tests/coordinator/test_cluster.py's batch (spread encodes; the prefill worker lends prompts to
# the decode worker whenever it has any waiting) and test_cluster_single_flight.py's bursts (its encoders are
# stopped for a moment without being declared dead before 3 s; one is killed, then declared dead).
LLAVA_2E1P1D_LENDING = Lean("llava", encode=2, prefill=1, decode=1, transfer="shm",
                            coordinator_args=("--local-prefill-tokens", "1", "--dead-after-s", "3"))
QWEN2_VL_UNIFIED = Lean("qwen2_vl", encode=0, prefill=0, decode=0, unified=1)


# Qwen3-VL's family clusters (dense and MoE) prefill in chunks of this many tokens: its video request is cut into several.
VIDEO_CHUNK = 48


def family_1e1p1d(arch: str) -> Lean:
    """The families' cluster (tests/coordinator/test_cluster_families.py), tcp between the stages."""
    # Qwen3.5 too: its linear layers carry their state across the prefill worker's chunks.
    chunked = ("--max-num-batched-tokens", str(VIDEO_CHUNK)) if arch.startswith("qwen3_vl") or arch.startswith("qwen3_5") else ()
    return Lean(arch, transfer="tcp", worker_args=chunked)


def leans_of(item: pytest.Item) -> set[Lean]:
    callspec = getattr(item, "callspec", None)
    return {v for v in callspec.params.values() if isinstance(v, Lean)} if callspec else set()


class SharedClusters:
    """The running shared clusters of a session (the `shared_clusters` fixture)."""

    def __init__(self, session: pytest.Session, model_dirs, current: Callable[[], pytest.Item | None]) -> None:
        self.session = session
        self.model_dirs = model_dirs
        self.current = current  # the test being run (tests/conftest.py records it at each set-up)
        self.running: dict[Lean, LocalCluster] = {}
        self._failed_at_get: dict[Lean, int] = {}

    def get(self, lean: Lean) -> LocalCluster:
        cluster = self.running.get(lean)
        if cluster is not None and any(p.poll() is not None for p in cluster.processes.values()):
            self.stop(lean)  # a process of it died: the next user gets a whole one
            cluster = None
        if cluster is None:
            cluster = LocalCluster(str(self.model_dirs[lean.arch]), encode=lean.encode, prefill=lean.prefill,
                                   decode=lean.decode, unified=lean.unified, transfer=lean.transfer,
                                   extra_worker_args=list(lean.worker_args),
                                   extra_coordinator_args=list(lean.coordinator_args)).start()
            self.running[lean] = cluster
        self._failed_at_get[lean] = self.session.testsfailed
        return cluster

    def release(self, lean: Lean) -> None:
        """After a user: stop it when no later test needs it, or when a test failed while holding it (what
        it left behind must not fail the next one)."""
        if lean not in self.running:
            return
        failed = self.session.testsfailed > self._failed_at_get.get(lean, 0)
        if failed or not self._needed_later(lean):
            self.stop(lean)

    def _needed_later(self, lean: Lean) -> bool:
        items, current = self.session.items, self.current()
        start = items.index(current) + 1 if current in items else 0
        return any(lean in leans_of(item) for item in items[start:])

    def stop(self, lean: Lean) -> None:
        cluster = self.running.pop(lean, None)
        if cluster is not None:
            cluster.stop()

    def stop_all(self) -> None:
        for lean in list(self.running):
            self.stop(lean)


def settled_counters(cluster: LocalCluster, timeout_s: float = 30.0) -> dict[str, dict]:
    """Every worker's counters once the coordinator's copy has caught up: no request in flight and the same
    counters in two STATUS reads three worker heartbeats (0.25 s each) apart, so a report still on its way
    lands between them. The baseline of a test that checks counter differences on a cluster others used."""
    from tests.helpers import wait_for

    last: list = [None]

    def steady() -> dict[str, dict] | None:
        with Client(cluster.address, timeout_s=10) as c:
            status = c.status()
        now = None if status["requests_in_flight"] else {
            wid: dict(w.get("counters", {})) for wid, w in status["workers"].items()}
        same, last[0] = now is not None and now == last[0], now
        return now if same else None

    return wait_for(steady, timeout_s=timeout_s, what="the workers' counters to settle in STATUS", every_s=0.75)
