"""Shared pytest fixtures for the MServe test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Tests never reach the network: models come from the local cache or not at all.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Clusters' children are forked from one interpreter that imported torch and transformers once
# (coordinator/spawn.py): a cluster starts in about half the time on two cores. tests/coordinator/test_spawn.py
# checks a forked child against an exec'd one; MSERVE_START_METHOD=exec runs the suite the users' way.
os.environ.setdefault("MSERVE_START_METHOD", "forkserver")
# The oracle is float32, bit for bit: the workers the suite starts run in float32 whatever this host's
# serving default is (bfloat16 on a CPU with native bf16, common/serving_defaults.py). The default path
# itself is tested with this variable removed (tests/coordinator/test_cluster_bf16.py,
# tests/workers/test_generate_cli.py), against HF in the dtype it picks.
os.environ.setdefault("MSERVE_DTYPE", "float32")
# Probe verdicts (workers/verdicts.py) of the session's checkpoints go to a folder of its own, not ~/.cache:
# every session proves its freshly built checkpoints again.
if "MSERVE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mserve-test-cache-")

# The package under test is the installed one (`make test` installs this checkout editable):
# common/, coordinator/, workers/ and bench/ import as mserve.* only through the install's
# package-dir mapping, so the repository root is deliberately not put on sys.path.

import pytest  # noqa: E402
import redis  # noqa: E402

from mserve.common.redis_server import RedisServer, find_redis_server  # noqa: E402


# ---- redis -------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, shared by the whole session."""
    try:
        binary = find_redis_server()
    except RuntimeError as e:
        pytest.skip(str(e))
    with RedisServer(binary=binary) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session server, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    yield redis_server.url


# ---- models ------------------------------------------------------------------


class TinyModelDirs(dict):
    """arch -> tiny checkpoint folder, each built offline on first use (a session pays only for the
    families its tests touch)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, arch: str) -> Path:
        from mserve.common.tiny_model import make_tiny_model
        from tests.workers.untested_families import BUILDERS

        if arch in BUILDERS:  # a family this repository has no code for (served after the load-time probe)
            self[arch] = BUILDERS[arch](self.root / arch)
        else:
            self[arch] = make_tiny_model(self.root / arch, arch, "tiny", seed=0)
        return self[arch]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random-weight checkpoint per family, built offline once per session when first asked for."""
    return TinyModelDirs(tmp_path_factory.mktemp("models"))


# ---- clusters shared across modules (tests/clusters.py) ---------------------

CURRENT_ITEM = pytest.StashKey[pytest.Item]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The fork server starts with the session's environment (not a test's monkeypatched one), its imports
    running while the first tests do."""
    from mserve.coordinator import spawn

    if spawn.default_start_method() == "forkserver":
        spawn.warm()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.session.stash[CURRENT_ITEM] = item  # a shared cluster stays up while a later test needs it


@pytest.fixture(scope="session")
def shared_clusters(request, tiny_model_dirs):
    """The session's running shared clusters, every one stopped by the end of the session."""
    from tests.clusters import SharedClusters

    pool = SharedClusters(request.session, tiny_model_dirs, lambda: request.session.stash.get(CURRENT_ITEM, None))
    yield pool
    pool.stop_all()


@pytest.fixture
def shared_cluster(request, shared_clusters):
    """The running cluster of the test's `Lean` param (indirect), shared with later tests of the same spec."""
    from tests.clusters import Lean

    lean = getattr(request, "param", None)
    if not isinstance(lean, Lean):
        raise TypeError("shared_cluster takes a tests.clusters.Lean: "
                        "@pytest.mark.parametrize('shared_cluster', [LLAVA_1E1P1D], indirect=True)")
    yield shared_clusters.get(lean)
    shared_clusters.release(lean)
