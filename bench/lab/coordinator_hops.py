"""Count the function hops from an ENCODED reply arriving at the coordinator to the PREFILL it triggers
(issue 51). Pure: a real request machine behind the real socket-side handlers, the socket send replaced
by a recorder; no processes.

The path is the union of the call chains (from `Coordinator._on_worker_frames` down) of every call
that carries the reply to the send: the queue write, the routing decision, building the PREFILL, any
outbox the PREFILL travels in, and the socket send. Prints the hops, in call order, and the files they are in.

    .venv/bin/python bench/lab/coordinator_hops.py
"""

from __future__ import annotations

import os
import sys

from mserve.common.protocol import MsgType
from mserve.common.protocol import body as with_header
from mserve.common.protocol.client import Generate, Sampling
from mserve.common.serde import encode
from mserve.coordinator import server
from mserve.coordinator.admission import Admitted, AdmittedImage
from mserve.coordinator.models import ServedModel
from mserve.coordinator.requests import RequestMachine

LANDMARKS = {"push", "route_prefill", "stage_message", "to_worker", "take", "send"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sent: list[tuple[MsgType, dict]] = []


def send(sock, kind, body, identity=b"", flags=0):  # stands in for common/sockets.send
    sent.append((kind, body))


class OneModel:
    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def of_worker(self, worker_id: str) -> ServedModel:
        return self.model

    def register(self, worker_id: str, info) -> ServedModel:
        return self.model

    def __iter__(self):
        return iter([self.model])


def main() -> None:
    machine = RequestMachine(raise_errors=True)
    coord = server.Coordinator.__new__(server.Coordinator)
    coord.models, coord.worker_sock = OneModel(ServedModel("m", "/m", None, machine)), None
    server.send = send
    for wid, role in (("e0", "encode"), ("p0", "prefill"), ("d0", "decode")):
        coord._on_worker_frames([Frame(wid.encode())] + frames(MsgType.READY, {
            "worker_id": wid, "role": role, "data_address": "tcp://127.0.0.1:1", "host_id": "h", "block_size": 16}))
    req = Generate(request_id="r1", messages=[{"role": "user", "content": "hi"}], sampling=Sampling(max_tokens=4))
    im = AdmittedImage(hash="img", data=b"png", size=(28, 28), num_tokens=4)
    coord._send(machine.submit(b"c", Admitted(req, list(range(100, 120)), [im]), now=0.0))
    (kind, task), = [s for s in sent if s[0] is MsgType.ENCODE]
    sent.clear()
    reply = frames(MsgType.ENCODED, {"request_id": task["request_id"], "attempt": 0, "descriptor": {"x": 1},
                                     "images": [{"hash": "img", "tokens": 4, "grid": [1, 2, 2]}]})
    chains: list[list[tuple[str, str]]] = []

    def carries_prefill(frame, event, arg) -> bool:
        """The message passes through here: it builds, routes or queues the request, or the PREFILL is in it."""
        name = frame.f_code.co_name
        if name == "take":  # an outbox: on the path only when what it hands over holds the PREFILL
            return event == "return" and any(m.kind is MsgType.PREFILL for m in arg or [])
        if event != "call":
            return False
        return name not in ("to_worker", "send") or frame.f_locals.get("kind") is MsgType.PREFILL

    def profile(frame, event, arg):
        if frame.f_code.co_name in LANDMARKS and frame.f_code.co_filename.startswith(ROOT) \
                and carries_prefill(frame, event, arg):
            chain, f = [], frame
            while f is not None:
                chain.append((os.path.relpath(f.f_code.co_filename, ROOT), f.f_code.co_name))
                if f.f_code.co_name == "_on_worker_frames":
                    chains.append(chain[::-1])
                    break
                f = f.f_back

    sys.setprofile(profile)
    coord._on_worker_frames([Frame(b"e0")] + reply)
    sys.setprofile(None)
    assert [k for k, _ in sent] == [MsgType.PREFILL], sent
    hops: list[tuple[str, str]] = []
    for chain in chains:
        hops += [h for h in chain if h not in hops]
    for path, name in hops:
        print(f"  {name:<22} {path}")
    print(f"ENCODED -> PREFILL: {len(hops)} hops across {len({p for p, _ in hops})} files")


class Frame:
    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def frames(kind: MsgType, payload: dict) -> list:
    return [bytes(f) for f in encode(kind, with_header(**payload))]


if __name__ == "__main__":
    main()
