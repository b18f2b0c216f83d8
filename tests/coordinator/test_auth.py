"""Authentication on the coordinator's links: the client API key, CURVE on the worker link, no pickle.

The fast tests run a real Coordinator (real sockets, the tiny llava's tokenizer) on a thread of the
test process, with raw sockets standing in for workers; the slow one runs a whole CURVE + API key
cluster of processes and checks its answer against transformers' generate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
import zmq

from mserve.common.protocol import MsgType, body
from mserve.common.protocol.to_coordinator import Bye, WorkerInfo
from mserve.common.security import CurveKeys, HandshakeWatch, cluster_keys, keygen
from mserve.common.serde import decode
from mserve.common.sockets import free_port, make_socket, send
from mserve.coordinator.client import AsyncClient, Client, Unauthorized
from tests.common.test_security import pickle_frames
from tests.helpers import wait_for

KEY = "s3cret-client-key"


@pytest.fixture(scope="module")
def coordinator(tiny_model_dirs, tmp_path_factory):
    """A coordinator requiring KEY from clients and CURVE from workers (worker-0 and probe authorized)."""
    import mserve.coordinator.server as server
    from mserve.coordinator.settings import CoordinatorSettings

    keys = tmp_path_factory.mktemp("keys")
    authorized = cluster_keys(keys, servers=["coordinator"], peers=["worker-0", "probe"])
    keygen(keys, "intruder")  # a keypair nobody authorized
    settings = CoordinatorSettings(
        model=str(tiny_model_dirs["llava"]), bind=f"tcp://127.0.0.1:{free_port()}",
        worker_bind=f"tcp://127.0.0.1:{free_port()}", client_api_key=KEY,
        curve_secret_key=str(keys / "coordinator.key_secret"), curve_authorized_keys=str(authorized))
    freeze, server.freeze_startup_heap = server.freeze_startup_heap, lambda: None  # not the test process's heap
    coord = server.Coordinator(settings)
    thread = threading.Thread(target=coord.serve_forever, daemon=True)
    thread.start()
    try:
        yield coord, keys
    finally:
        server.freeze_startup_heap = freeze
        coord.stop()
        thread.join(timeout=5)
        coord.close()


def status(coord, api_key: str | None = KEY) -> dict:
    with Client(coord.settings.bind, timeout_s=5, api_key=api_key) as c:
        return c.status()


class RawWorker:
    """A DEALER speaking the worker protocol by hand, with a CURVE keypair from ``keys``."""

    def __init__(self, coord, keys: Path, name: str) -> None:
        me = CurveKeys.from_files(str(keys / f"{name}.key_secret"), server_key=str(keys / "coordinator.key"))
        self.name = name
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER, connect=coord.settings.worker_bind,
                                identity=name.encode(), curve=me.client())
        self.watch = HandshakeWatch(self.sock)

    def send(self, msg, kind=None) -> bool:
        try:
            send(self.sock, kind or msg.KIND, msg.to_body(), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # IMMEDIATE: not connected (yet, or ever)
            return False

    def ready(self) -> bool:
        return self.send(WorkerInfo(worker_id=self.name, role="decode", data_address="tcp://127.0.0.1:9",
                                    host_id="test"))

    def close(self) -> None:
        self.send(Bye(worker_id=self.name))
        self.watch.close()
        self.sock.close(linger=100)


def test_client_api_key_is_required(coordinator, monkeypatch) -> None:
    coord, _ = coordinator
    monkeypatch.delenv("MSERVE_CLIENT_API_KEY", raising=False)  # no fallback: exactly these keys
    before = status(coord)["stats"]
    for key in (None, "wrong", ""):
        with Client(coord.settings.bind, timeout_s=5, api_key=key) as c:
            with pytest.raises(Unauthorized, match="api_key"):
                c.status()
            with pytest.raises(Unauthorized, match="missing api_key" if not key else "wrong api_key"):
                c.generate([{"role": "user", "content": "hi"}], max_tokens=2)
            c.abort("whatever")

    async def async_client(key: str | None) -> None:
        async with AsyncClient(coord.settings.bind, timeout_s=5, api_key=key) as c:
            with pytest.raises(Unauthorized):
                await c.status()
            with pytest.raises(Unauthorized):
                await c.generate([{"role": "user", "content": "hi"}], max_tokens=2)
    for key in (None, "wrong"):
        asyncio.run(async_client(key))
    after = status(coord)
    assert after["stats"]["admitted"] == before["admitted"] and after["stats"]["rejected"] == before["rejected"]
    assert after["requests_in_flight"] == 0 and after["unauthorized"] >= 13


def test_unknown_worker_is_refused_at_the_handshake(coordinator, caplog) -> None:
    coord, keys = coordinator
    caplog.set_level(logging.WARNING, logger="mserve.common.security")
    good, bad = RawWorker(coord, keys, "worker-0"), RawWorker(coord, keys, "intruder")
    plain = make_socket(zmq.Context.instance(), zmq.DEALER, connect=coord.settings.worker_bind,
                        identity=b"plain-0")
    try:
        wait_for(good.ready, what="the authorized worker to connect")
        wait_for(lambda: status(coord)["workers"].get("worker-0", {}).get("alive"), what="worker-0 alive")
        why = wait_for(bad.watch.failure, what="the intruder's handshake to be refused")
        assert "not in the peer's authorized keys folder" in why
        assert not bad.ready() and not plain.poll(100, zmq.POLLOUT)  # neither ever connects
        workers = status(coord)["workers"]
        assert "intruder" not in workers and "plain-0" not in workers
        assert "refused a peer whose CURVE public key" in caplog.text
    finally:
        good.close()
        bad.close()
        plain.close(0)


def test_pickle_is_refused_on_both_coordinator_sockets(coordinator, tmp_path, caplog) -> None:
    coord, keys = coordinator
    marker = tmp_path / "unpickled"
    client = make_socket(zmq.Context.instance(), zmq.DEALER, connect=coord.settings.bind)
    probe = RawWorker(coord, keys, "probe")
    caplog.set_level(logging.ERROR, logger="mserve.coordinator")
    try:
        for frames in pickle_frames(marker):  # (a) the client ROUTER answers ERROR bad_message
            client.send_multipart(frames)
            assert client.poll(5000), "no reply to a pickle payload"
            kind, reply = decode(client.recv_multipart())
            assert kind == MsgType.ERROR and reply["code"] == "bad_message"
        wait_for(probe.ready, what="the probe worker to connect")
        for frames in pickle_frames(marker):  # (b) the worker ROUTER logs and drops it
            probe.sock.send_multipart(frames)
        wait_for(lambda: caplog.text.count("dropped a bad message from worker") >= 2, what="both drops logged")
        # Both sockets keep serving: a valid STATUS is answered, the probe's READY registered.
        send(client, MsgType.STATUS, body(api_key=KEY))
        assert client.poll(5000) and decode(client.recv_multipart())[0] == MsgType.STATUS_REPLY
        wait_for(lambda: status(coord)["workers"].get("probe", {}).get("alive"), what="probe alive")
    finally:
        probe.close()
        client.close(0)
    assert not marker.exists()


@pytest.mark.slow
def test_curve_cluster_serves_exactly_and_refuses_unauthenticated_clients(tiny_model_dirs, redis_url, tmp_path):
    from mserve.common.prompt import PromptBuilder
    from mserve.coordinator.launcher import LocalCluster
    from tests.helpers import chat, hf_generate, make_image

    model = str(tiny_model_dirs["llava"])
    image = make_image(64, 48, seed=3)
    with LocalCluster(model, redis_url=redis_url, transfer="tcp", client_api_key=KEY,
                      curve_dir=tmp_path / "keys") as cluster:
        with Client(cluster.address, timeout_s=60, api_key=KEY) as c:
            result = c.generate(chat("What is in the picture?", [image]), max_tokens=8)
            st = c.status()
        with Client(cluster.address, timeout_s=10, api_key="wrong") as c, pytest.raises(Unauthorized):
            c.generate(chat("hi"), max_tokens=2)
        coordinator_log = cluster.log_path("coordinator").read_text()
    assert {w for w, info in st["workers"].items() if info["alive"]} == {"encode-0", "prefill-0", "decode-0"}
    assert st["stats"]["admitted"] == 1 and st["unauthorized"] == 0
    prompt = PromptBuilder(model).prepare_text("What is in the picture?", [image]).prompt_ids
    assert result.token_ids == hf_generate(model, prompt, [image], 8)
    assert result.timings["transfer_s"] > 0  # tensors crossed the CURVE data plane
    assert "worker link: CURVE" in coordinator_log and KEY not in coordinator_log
