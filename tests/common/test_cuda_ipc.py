"""The torch backend's CUDA IPC path (mserve.common.transfer.cuda_ipc): a receiver on the sender's
own GPU copies the flat buffer through a CUDA IPC handle, since NCCL cannot pair two processes on
one GPU. The wire and the refusals are checked everywhere; the copy itself only where CUDA is
(bench/gpu_check.md runs this module on the GPU machine)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import msgpack
import pytest
import torch

from mserve.common.protocol.data_plane import FetchRequest, TorchReady
from mserve.common.transfer import TransferEngine, cuda_ipc
from mserve.common.transfer.torch_pairs import TorchReceiver, TorchSender

pytestmark = pytest.mark.timeout(120)


def test_no_gpu_identity_off_cuda() -> None:
    assert cuda_ipc.gpu_identity("cpu", "host") is None
    assert TorchReceiver("127.0.0.1", "cpu", lambda: None).gpu is None


def test_the_wire_carries_the_gpu_and_the_handle() -> None:
    req = FetchRequest(id="t", mode="torch", peer="p", gpu="boot/1/GPU-abc")
    assert FetchRequest.from_body(msgpack.unpackb(msgpack.packb(req.to_body()))) == req
    handle = [64, 0, b"\x01" * 64, 2 << 20, 0, b"/torch_1_2", 3, b"\x02" * 64, True]
    ready = TorchReady(rq=1, ipc=handle)
    assert TorchReady.from_body(msgpack.unpackb(msgpack.packb(ready.to_body()))).ipc == handle
    assert TorchReady.from_body(msgpack.unpackb(msgpack.packb(TorchReady(rq=2, tag=1).to_body()))).ipc is None


def test_a_host_buffer_never_goes_through_ipc() -> None:
    """Only a CUDA buffer is shared by handle; a host one takes the gloo group as before."""
    sender = TorchSender("127.0.0.1", 5.0, lambda: None)
    try:
        reply = sender.serve(None, "peer", torch.ones(8, dtype=torch.uint8), "t", gpu="any/GPU-x")
        assert "ipc" not in reply and reply["tag"] == 1 and reply["store"]
    finally:
        sender.close()


def test_a_malformed_handle_is_refused() -> None:
    with pytest.raises(ValueError, match="9 parts"):
        cuda_ipc.open_copy([1, 2, 3], 1, "cuda")
    with pytest.raises(ValueError, match="holds 64 B, the descriptor says 128"):
        cuda_ipc.open_copy([64, 0, b"", 0, 0, b"", 0, None, False], 128, "cuda")


# --------------------------------------------------------------------------- on a GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.md runs it there)")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(2, 4, 16, 8, 64, generator=g).to(torch.bfloat16),
            "hidden": torch.randn(300, 96, generator=g), "empty": torch.empty(0, 5),
            "ids": torch.arange(seed, seed + 77)}


def _sender_main(conn: Any) -> None:
    engine = TransferEngine("gpu-sender", backend="torch", device="cuda")
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "publish":
                tid, seed = args
                conn.send(engine.publish(tid, {k: t.cuda() for k, t in _tensors(seed).items()}).to_wire())
            elif cmd == "pending":
                deadline = time.monotonic() + 10
                while engine.pending() and time.monotonic() < deadline:
                    time.sleep(0.01)
                conn.send((engine.pending(), engine.stats()["torch_groups"]))
            else:
                break
    finally:
        engine.close()


@cuda
def test_two_processes_on_one_gpu_copy_through_ipc() -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child,), daemon=True)
    proc.start()
    try:
        with TransferEngine("gpu-receiver", device="cuda") as rx:
            for seed in range(3):  # the second and third reuse nothing but must not go stale either
                conn.send(("publish", f"ipc-{seed}", seed))
                assert conn.poll(60), "the sender did not publish"
                got = rx.fetch(conn.recv(), timeout_s=30)
                for name, want in _tensors(seed).items():
                    assert got[name].is_cuda and got[name].dtype == want.dtype and got[name].shape == want.shape
                    assert torch.equal(got[name].cpu().view(torch.uint8) if want.numel() else got[name].cpu(),
                                       want.view(torch.uint8) if want.numel() else want), name
                got["hidden"].add_(1.0)  # the receiver's own memory, writable
            stats = rx.stats()
            assert stats["cuda_ipc_fetches"] == 3 and stats["torch_groups"] == 0
            conn.send(("pending",))
            assert conn.poll(30)
            pending, groups = conn.recv()
            assert pending == 0, "every transfer was acked and freed"
            assert groups == 0, "no NCCL group was built"
    finally:
        conn.send(("exit",))
        proc.join(30)
