"""Tests for mserve.common.transfer: real sender and receiver processes over shm, tcp and torch."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from mserve.common.transfer import Descriptor, TransferEngine, TransferError

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["shm", "tcp", "torch"]
REPO = Path(__file__).resolve().parents[2]


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Deterministic payload both processes can rebuild: every dtype case from the brief."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(768, 1024, generator=g),  # 3 MiB float32
        "ids": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "kv_bf16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        # Every bf16 bit pattern (NaNs, infinities, -0, subnormals) in an exported KV block's 6-D
        # shape [layers, 2, blocks, block_size, kv_heads, head_dim], rolled by the seed.
        "kv_bf16_all_bits": torch.arange(-(2**15), 2**15, dtype=torch.int32).roll(seed).to(torch.int16)
        .view(torch.bfloat16).view(2, 2, 8, 16, 8, 16),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(seed + 0.5),
        "transposed": torch.randn(40, 96, generator=g).t(),  # non-contiguous input
    }


def assert_same(got: dict[str, torch.Tensor], seed: int) -> None:
    want = make_tensors(seed)
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        if t.dtype == torch.bfloat16:  # bit for bit: NaN != NaN, and numpy has no bf16 to lean on
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
        else:
            assert torch.equal(got[name], t), name


# --------------------------------------------------------------------------- sender process


def _sender_main(conn: Any) -> None:
    """A worker process that publishes on command and reports its engine's state."""
    engine = TransferEngine("sender")
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "publish":
                tid, backend, seed, ttl_s = args
                conn.send(engine.publish(tid, make_tensors(seed), backend=backend, ttl_s=ttl_s))
            elif cmd == "wait_pending":  # the ack is asynchronous: give it a moment to land
                want, timeout_s = args
                deadline = time.monotonic() + timeout_s
                while engine.pending() != want and time.monotonic() < deadline:
                    time.sleep(0.01)
                conn.send(engine.pending())
            elif cmd == "stats":
                conn.send(engine.stats())
            elif cmd == "exit":
                break
    finally:
        engine.close()
        conn.send("closed")


class SenderProc:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *cmd: Any, timeout_s: float = 20.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"sender did not answer {cmd[0]}")
        return self.conn.recv()

    def publish(self, tid: str, backend: str, seed: int, ttl_s: float | None = None) -> Descriptor:
        return self.call("publish", tid, backend, seed, ttl_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.call("exit")
        self.proc.join(10)


@pytest.fixture(scope="module")
def sender() -> Iterator[SenderProc]:
    proc = SenderProc()
    yield proc
    proc.stop()
    assert proc.proc.exitcode == 0


@pytest.fixture(scope="module")
def receiver() -> Iterator[TransferEngine]:
    engine = TransferEngine("receiver")
    yield engine
    engine.close()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip(sender: SenderProc, receiver: TransferEngine, backend: str) -> None:
    before = receiver.stats()["bytes_received"][backend]
    desc = sender.publish(f"rt-{backend}", backend, seed=1)
    assert desc.backend == backend
    wire = msgpack.unpackb(msgpack.packb(desc.to_wire()))  # the control plane can carry it
    assert wire == desc.to_wire() and Descriptor.from_wire(wire) == desc
    got = receiver.fetch(wire, timeout_s=10)
    assert_same(got, seed=1)
    got["hidden"].add_(1.0)  # the receiver owns writable memory
    assert sender.call("wait_pending", 0, 5.0) == 0
    payload = sum(t.numel() * t.element_size() for t in make_tensors(1).values())
    assert receiver.stats()["bytes_received"][backend] - before == payload
    if backend == "shm":  # acked: back in the sender's pool for the next transfer, not unlinked
        assert os.path.exists(f"/dev/shm/{desc.shm}")
        assert sender.call("stats")["shm_pool"]["recycled"] >= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_view_roundtrip(sender: SenderProc, receiver: TransferEngine, backend: str) -> None:
    desc = sender.publish(f"view-{backend}", backend, seed=12)
    with receiver.fetch_view(desc, timeout_s=10) as got:
        assert_same(got, seed=12)
        if backend == "shm":  # views of the sender's segment: no ack until released
            assert sender.call("wait_pending", 0, 0.3) == 1
    assert sender.call("wait_pending", 0, 5.0) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_transfers_reuse_pair(sender: SenderProc, backend: str) -> None:
    groups_before = sender.call("stats")["torch_groups"]
    with TransferEngine("receiver-2") as rx:
        for i in range(2):
            desc = sender.publish(f"reuse-{backend}-{i}", backend, seed=10 + i)
            assert_same(rx.fetch(desc, timeout_s=10), seed=10 + i)
            assert sender.call("wait_pending", 0, 5.0) == 0
        expected_groups = 1 if backend == "torch" else 0
        assert rx.stats()["torch_groups"] == expected_groups
    assert sender.call("stats")["torch_groups"] - groups_before == expected_groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_transfer_id(sender: SenderProc, receiver: TransferEngine, backend: str) -> None:
    desc = sender.publish(f"known-{backend}", backend, seed=2)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="unknown transfer id"):
        receiver.fetch(dict(desc.to_wire(), id=f"never-published-{backend}"), timeout_s=10)
    assert time.monotonic() - t0 < 2.0, "an unknown id is answered, not timed out"
    assert_same(receiver.fetch(desc, timeout_s=10), seed=2)
    # The ack travels on its own socket, so over tcp a second request can overtake it: the
    # promise is that a second fetch fails once the sender has the ack, not before.
    assert sender.call("wait_pending", 0, 5.0) == 0
    with pytest.raises(TransferError, match="unknown transfer id"):  # already fetched and freed
        receiver.fetch(desc, timeout_s=10)


def test_dead_sender(receiver: TransferEngine) -> None:
    doomed = SenderProc()
    descs = [doomed.publish(f"dead-{b}", b, seed=3) for b in ("tcp", "torch")]
    doomed.proc.kill()
    doomed.proc.join(10)
    for desc in descs:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="sender"):
            receiver.fetch(desc, timeout_s=1.0)
        assert time.monotonic() - t0 < 2.0


def test_unfetched_transfers_are_reclaimed(sender: SenderProc, receiver: TransferEngine) -> None:
    expired_before = sender.call("stats")["expired"]
    descs = [sender.publish(f"ttl-{b}", b, seed=4, ttl_s=0.3) for b in BACKENDS]
    assert sender.call("wait_pending", 0, 5.0) == 0
    assert sender.call("stats")["expired"] - expired_before == len(BACKENDS)
    deadline = time.monotonic() + 5  # the reaper stops tracking a transfer, then unlinks it
    while os.path.exists(f"/dev/shm/{descs[0].shm}") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not os.path.exists(f"/dev/shm/{descs[0].shm}")
    for desc in descs:
        with pytest.raises(TransferError, match="unknown transfer id"):
            receiver.fetch(desc, timeout_s=5)


def test_auto_picks_shm_on_same_host(sender: SenderProc, receiver: TransferEngine) -> None:
    before = receiver.stats()["bytes_received"]
    desc = sender.publish("auto-local", "auto", seed=5)
    assert desc.host_id == receiver.host_id
    assert_same(receiver.fetch(desc, timeout_s=10), seed=5)
    after = receiver.stats()["bytes_received"]
    assert after["shm"] > before["shm"] and after["tcp"] == before["tcp"]

    # A receiver on another host cannot see the segment: the same transfer comes over tcp.
    desc = sender.publish("auto-remote", "auto", seed=6)
    assert_same(receiver.fetch(replace(desc, host_id="some-other-host"), timeout_s=10), seed=6)
    assert receiver.stats()["bytes_received"]["tcp"] > after["tcp"]
    assert sender.call("wait_pending", 0, 5.0) == 0


def test_release_and_close_free_segments() -> None:
    with TransferEngine("local") as engine:
        kept = engine.publish("kept", make_tensors(8), backend="shm")
        dropped = engine.publish("dropped", make_tensors(8), backend="shm")
        engine.release("dropped")
        engine.release("dropped")  # idempotent
        assert engine.pending() == 1
        assert not os.path.exists(f"/dev/shm/{dropped.shm}")
        assert os.path.exists(f"/dev/shm/{kept.shm}")
        with pytest.raises(ValueError, match="already published"):
            engine.publish("kept", make_tensors(8))
    assert not os.path.exists(f"/dev/shm/{kept.shm}"), "close() frees what is still pending"


def _shm_receiver_main(queue: Any, results: Any) -> None:
    with TransferEngine("rx-spawned") as rx:
        for _ in range(2):
            desc = queue.get(timeout=20)
            assert_same(rx.fetch(desc, timeout_s=10), seed=7)
        results.put("ok")


def _independent_receiver_main() -> None:
    """Receiver in an unrelated interpreter (its own resource tracker); descriptors on stdin."""
    with TransferEngine("rx-independent") as rx:
        for line in sys.stdin:
            assert_same(rx.fetch(json.loads(line), timeout_s=10), seed=7)
            print("ok", flush=True)


def _shm_tracker_scenario() -> None:
    """The sender (this process) serves two receivers: a spawned child, which shares this
    process's resource tracker, and an unrelated interpreter, which has its own."""
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_shm_receiver_main, args=(queue, results))
    child.start()
    code = "import test_transfer; test_transfer._independent_receiver_main()"
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    with TransferEngine("tx") as tx:
        for i, backend in enumerate(("shm", "auto")):
            queue.put(tx.publish(f"spawned-{i}", make_tensors(7), backend=backend))
            desc = tx.publish(f"other-{i}", make_tensors(7), backend=backend)
            other.stdin.write(json.dumps(desc.to_wire()) + "\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "ok"
        other.stdin.close()
        assert results.get(timeout=30) == "ok"
        deadline = time.monotonic() + 5
        while tx.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.pending() == 0
    child.join(10)
    assert child.exitcode == 0
    assert other.wait(10) == 0


def test_shm_leaves_resource_tracker_quiet() -> None:
    """No 'leaked shared_memory' warning and no tracker KeyError (double unregister) on stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]))
    code = "import test_transfer; test_transfer._shm_tracker_scenario(); print('done')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
