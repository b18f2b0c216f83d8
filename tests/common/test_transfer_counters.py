"""The transfer engine's per-backend counters (``TransferEngine.counters``, in every worker heartbeat):
which backend actually moved each transfer. tests/multihost/test_netns.py reads them across real
hosts; here one process plays both sides, and a descriptor naming another host id stands in for a
receiver on another host."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from mserve.common.transfer import TransferEngine

pytestmark = pytest.mark.timeout(60)


def test_counters_name_the_backend_that_moved_each_transfer():
    tensors = {"x": torch.arange(1024, dtype=torch.float32)}  # 4096 B: no alignment padding
    with TransferEngine("tx") as tx, TransferEngine("rx") as rx:
        assert rx.counters() == {f"transfer_{k}_{b}": 0 for k in ("fetched", "sent_bytes")
                                 for b in ("shm", "tcp", "torch")}
        got = rx.fetch(tx.publish("same-host", tensors))  # auto, same host id: shared memory
        assert torch.equal(got["x"], tensors["x"])
        elsewhere = replace(tx.publish("other-host", tensors), host_id="another-boot/another-ipc")
        assert torch.equal(rx.fetch(elsewhere)["x"], tensors["x"])  # auto, another host: tcp
        rx.fetch(tx.publish("forced-tcp", tensors, backend="tcp"))
        deadline = time.monotonic() + 10
        while tx.stats()["acked"] < 3 and time.monotonic() < deadline:  # shm is counted on its ack
            time.sleep(0.002)
        assert {k: v for k, v in rx.counters().items() if k.startswith("transfer_fetched_")} == {
            "transfer_fetched_shm": 1, "transfer_fetched_tcp": 2, "transfer_fetched_torch": 0}
        sent = tx.counters()
        assert (sent["transfer_sent_bytes_shm"], sent["transfer_sent_bytes_tcp"]) == (4096, 2 * 4096)
        assert sent["transfer_fetched_shm"] == sent["transfer_fetched_tcp"] == 0  # the sender fetched nothing
