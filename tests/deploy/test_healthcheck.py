"""The container health probes (python -m mserve.healthcheck) that deploy/ uses: verdicts, and against a real Redis."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from mserve import healthcheck
from mserve.common.redis_store import RedisStore
from mserve.healthcheck import worker_verdict

NOW = 1000.0


def _verdict(**kw):
    args = dict(ready=False, coordinator=None, coordinator_error="down", loads=None, now=NOW, max_age_s=15.0)
    return worker_verdict("w1", **{**args, **kw})


def test_readiness_needs_the_coordinator_to_list_the_worker_alive():
    assert _verdict(ready=True, coordinator={"workers": {"w1": {"alive": True}}}) == (True, "alive at the coordinator")
    assert not _verdict(ready=True, coordinator={"workers": {"w1": {"alive": False}}})[0]
    assert not _verdict(ready=True, coordinator={"workers": {"w2": {"alive": True}}})[0]
    ok, why = _verdict(ready=True)
    assert not ok and "down" in why


def test_liveness_reads_the_heartbeat_then_the_coordinator_then_gives_up_judging():
    assert _verdict(loads={"w1": {"updated_at": NOW - 3}})[0]
    assert not _verdict(loads={"w1": {"updated_at": NOW - 60}})[0]
    assert not _verdict(loads={})[0]  # Redis read, this worker's load is gone: its heartbeats stopped
    assert not _verdict(coordinator={"workers": {"w1": {"alive": False}}})[0]  # Redis not read
    assert _verdict(coordinator={"workers": {"w1": {"alive": True}}})[0]
    assert _verdict()[0]  # neither source: another component's outage does not restart workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_probe_against_redis(redis_url, capsys):
    store = RedisStore(redis_url)
    try:
        store.publish_load("fresh", {"queue_len": 0})
        store.publish_load("stale", {"queue_len": 0, "updated_at": repr(time.time() - 120)})
    finally:
        store.close()
    nobody = f"tcp://127.0.0.1:{_free_port()}"
    base = ["worker", "--redis", redis_url, "--timeout", "0.3"]
    assert healthcheck.main([*base, "--worker-id", "fresh"]) == 0
    assert healthcheck.main([*base, "--worker-id", "stale"]) == 1
    assert healthcheck.main([*base, "--worker-id", "missing"]) == 1
    # Readiness asks the coordinator, which is not there.
    assert healthcheck.main([*base, "--worker-id", "fresh", "--ready", "--coordinator", nobody]) == 1
    out = capsys.readouterr().out
    assert "healthy: worker: load published" in out and "no load of worker 'missing'" in out
    assert healthcheck.main(["coordinator", "--coordinator", nobody, "--timeout", "0.3"]) == 1


def test_worker_probe_needs_an_id(monkeypatch):
    monkeypatch.delenv("MSERVE_WORKER_ID", raising=False)
    assert healthcheck.main(["worker"]) == 1


@pytest.fixture
def http_server():
    codes = {"/ok": 200, "/health": 503}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(codes.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_probe(http_server):
    assert healthcheck.main(["http", f"{http_server}/ok"]) == 0
    assert healthcheck.main(["http", f"{http_server}/health"]) == 1
    assert healthcheck.main(["http", f"http://127.0.0.1:{_free_port()}/health", "--timeout", "0.5"]) == 1
