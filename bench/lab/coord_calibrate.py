"""The coordinator's CPU per message: the real coordinator process, driven by fake workers that answer at once.

Usage: python -m lab.coord_calibrate --model models/small-llava [--json-out FILE]

One `mserve coordinator` process (with a private Redis, as `mserve up` runs it) serves a client
and fake encode / prefill / decode workers living in this process: they speak the real protocol
(READY, heartbeats every 0.25 s with their load, loads in Redis, ENCODED / PREFILLED /
STEP_TOKENS) but do no model work, so the coordinator is the only thing being paid for. Its CPU
time (utime + stime from /proc, the ZeroMQ I/O thread included) is read around each run, and
every message to and from it is counted. Runs:

* idle, with 3 and with 48 workers: the cost of heartbeats, Redis load reads and ticks per worker;
* closed-loop requests (image or text, 2 or 33 output tokens, 1 or 8 in flight): a least-squares
  fit gives CPU per request (admission + the 6 stage messages + RESULT), per STEP_TOKENS message,
  and per token item (the item in, TOKENS out to a streaming client).

Sharded coordinators (docs/scaling.md), K shards side by side with one:
``python -m lab.coord_calibrate --model models/small-llava --shards 2 [--json-out FILE]``,
the same as ``python -m lab.coord_shards`` (see there); FakeCluster below serves both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

HEARTBEAT_S = 0.25


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FakeCluster:
    """A client plus fake workers, all polled from this one thread.

    With several coordinator shards (lists of addresses, shard i at index i of both), the client keeps
    one DEALER per shard and sends each request to ``pick_shard(request id, client addresses)``; each
    fake worker keeps one DEALER per shard under one identity (as workers/links.py does), sends
    READY and heartbeats to every shard, answers a stage message on the socket it came in on, and
    splits a decode step's tokens into one STEP_TOKENS per shard.
    """

    def __init__(self, client_addr: str | list[str], worker_addr: str | list[str], redis_url: str,
                 model: str = "m") -> None:
        from mserve.common.redis_store import RedisStore

        self.model = model  # the served model the fake workers register for (the coordinator's --model)
        self.ctx = zmq.Context.instance()
        self.client_addrs = [client_addr] if isinstance(client_addr, str) else list(client_addr)
        self.worker_addrs = [worker_addr] if isinstance(worker_addr, str) else list(worker_addr)
        if len(self.client_addrs) != len(self.worker_addrs):
            raise ValueError("one client address and one worker address per shard")
        self.poller = zmq.Poller()
        self.clients: list[zmq.Socket] = []
        self._shard_of: dict[int, int] = {}  # id(socket) -> shard index
        for i, address in enumerate(self.client_addrs):
            sock = self.ctx.socket(zmq.DEALER)
            sock.connect(address)
            self.clients.append(sock)
            self._shard_of[id(sock)] = i
            self.poller.register(sock, zmq.POLLIN)
        self.store = RedisStore(redis_url)
        self.workers: dict[str, tuple[str, list[zmq.Socket]]] = {}
        self.decoding: dict[str, dict[str, Any]] = {}  # rid -> attempt, left, first, socket
        self.msgs = {"to_coordinator": 0, "from_coordinator": 0, "step_msgs": 0, "token_items": 0}
        # Per shard: requests sent to it, RESULT/ERROR from it, messages either way.
        self.by_shard = [{"requests": 0, "results": 0, "messages": 0} for _ in self.client_addrs]
        self.results = 0
        self._next_beat = 0.0

    def submit(self, body: dict[str, Any]) -> int:
        """Send a GENERATE to the shard that owns its request id; returns that shard's index."""
        from mserve.common.protocol import MsgType
        from mserve.common.shards import pick_shard
        from mserve.common.sockets import send

        shard = self.client_addrs.index(pick_shard(body["request_id"], self.client_addrs))
        send(self.clients[shard], MsgType.GENERATE, body)
        self.msgs["to_coordinator"] += 1
        self.by_shard[shard]["requests"] += 1
        self.by_shard[shard]["messages"] += 1
        return shard

    def _count(self, sock: zmq.Socket, direction: str, n: int = 1) -> None:
        self.msgs[direction] += n
        self.by_shard[self._shard_of[id(sock)]]["messages"] += n

    def add_worker(self, wid: str, role: str) -> None:
        from mserve.common.protocol import MsgType
        from mserve.common.sockets import send

        socks = []
        for i, address in enumerate(self.worker_addrs):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, wid.encode())
            sock.connect(address)
            self._shard_of[id(sock)] = i
            self.poller.register(sock, zmq.POLLIN)
            socks.append(sock)
        self.workers[wid] = (role, socks)
        self.store.register_worker(wid, {"worker_id": wid, "role": role}, ttl_s=3.0)
        for sock in socks:
            send(sock, MsgType.READY, self._info(wid, role).to_body())

    def _info(self, wid: str, role: str) -> Any:
        from mserve.common.protocol.to_coordinator import WorkerInfo, WorkerLoad

        load = WorkerLoad(queue_len=0, running=len(self.decoding) if role == "decode" else 0, queued=[],
                          free_blocks=2000, total_blocks=2048, tokens_per_s=100.0, rss_mib=900.0,
                          weights_mib=104.2, kv_pool_mib=512.0, counters={"steps": 1, "decode_tokens": 1},
                          at=time.time())
        return WorkerInfo(worker_id=wid, role=role, data_address="tcp://127.0.0.1:1", host_id="calib", pid=1,
                          model=self.model, model_path=self.model, block_size=16, num_blocks=2048, load=load)

    def heartbeat(self) -> None:
        from mserve.common.protocol import MsgType
        from mserve.common.protocol.to_coordinator import Heartbeat
        from mserve.common.sockets import send
        from mserve.workers.worker_redis import redis_load

        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        for wid, (role, socks) in self.workers.items():
            info = self._info(wid, role)
            body = Heartbeat.of(info).to_body()
            for sock in socks:
                send(sock, MsgType.HEARTBEAT, body)
                self._count(sock, "to_coordinator")
            self.store.heartbeat(wid, ttl_s=3.0)
            self.store.publish_load(wid, redis_load(info.load), ttl_s=3.0)

    def close(self) -> None:
        for _, socks in self.workers.values():
            for sock in socks:
                sock.close(0)
        for sock in self.clients:
            sock.close(0)
        self.store.close()

    # -- one turn of the event loop ---------------------------------------------------------------
    def turn(self, timeout_ms: int) -> None:
        self.heartbeat()
        events = dict(self.poller.poll(timeout_ms))
        for sock in self.clients:
            if sock in events:
                self._drain_client(sock)
        for wid, (role, socks) in self.workers.items():
            for sock in socks:
                if sock in events:
                    self._drain_worker(wid, role, sock)
        self._decode_step()

    def _drain_client(self, sock: zmq.Socket) -> None:
        from mserve.common.protocol import MsgType
        from mserve.common.sockets import recv

        while True:
            try:
                _, kind, body = recv(sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._count(sock, "from_coordinator")
            if kind in (MsgType.RESULT, MsgType.ERROR):
                self.results += 1
                self.by_shard[self._shard_of[id(sock)]]["results"] += 1
                if kind == MsgType.ERROR:
                    raise RuntimeError(f"coordinator answered ERROR: {body}")

    def _drain_worker(self, wid: str, role: str, sock: zmq.Socket) -> None:
        from mserve.common.protocol import MsgType
        from mserve.common.protocol.to_coordinator import Encoded, EncodedImageInfo, Prefilled
        from mserve.common.sockets import recv, send

        while True:
            try:
                _, kind, b = recv(sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._count(sock, "from_coordinator")
            kind = MsgType(kind)
            rid, attempt = b.get("request_id"), b.get("attempt")
            if kind == MsgType.ENCODE:
                images = [EncodedImageInfo(hash=im["hash"], tokens=576) for im in b["images"]]
                desc = {"backend": "shm", "transfer_id": f"{rid}:{attempt}:emb", "sender": wid, "fake": True}
                send(sock, MsgType.ENCODED, Encoded(request_id=rid, attempt=attempt, descriptor=desc, images=images,
                                                    worker_s=0.001).to_body())
            elif kind == MsgType.PREFILL:
                state = {"request_id": rid, "prompt_ids": b["prompt_ids"], "output_ids": [],
                         "num_computed_tokens": len(b["prompt_ids"]), "block_size": 16,
                         "images": [[5, 576, h] for h in b.get("image_hashes", [])], "rope_delta": 0,
                         "sampling": b["sampling"], "priority": 0, "latency_class": "interactive"}
                desc = {"backend": "shm", "transfer_id": f"{rid}:{attempt}:kv", "sender": wid, "fake": True}
                send(sock, MsgType.PREFILLED, Prefilled(request_id=rid, attempt=attempt, token_id=7,
                                                        finish_reason="prefilled", descriptor=desc, state=state,
                                                        worker_s=0.001).to_body())
            elif kind == MsgType.DECODE:
                left = int(b["state"]["sampling"]["max_tokens"]) - 1
                self.decoding[rid] = {"attempt": attempt, "left": left, "first": True, "sock": sock}
                continue
            else:
                continue
            self._count(sock, "to_coordinator")

    def _decode_step(self) -> None:
        """One 'engine step' per decode worker: one token for every request it holds, one STEP_TOKENS
        per shard that owns some of them (its socket to that shard)."""
        from mserve.common.protocol import MsgType
        from mserve.common.protocol.to_coordinator import StepTokens, TokenItem
        from mserve.common.sockets import send

        by_sock: dict[int, tuple[zmq.Socket, list[Any]]] = {}
        for rid, d in list(self.decoding.items()):
            d["left"] -= 1
            done = d["left"] <= 0
            item = TokenItem(request_id=rid, attempt=d["attempt"], token_ids=[8], finished=done,
                             finish_reason="length" if done else None, first=d["first"],
                             fetch_s=0.001 if d["first"] else None, worker_s=0.01 if done else None,
                             cached_tokens=0 if done else None)
            d["first"] = False
            by_sock.setdefault(id(d["sock"]), (d["sock"], []))[1].append(item)
            if done:
                del self.decoding[rid]
        for sock, items in by_sock.values():
            send(sock, MsgType.STEP_TOKENS, StepTokens(items=items).to_body())
            self._count(sock, "to_coordinator")
            self.msgs["step_msgs"] += 1
            self.msgs["token_items"] += len(items)


def _bodies(model: str, modality: str, n: int, max_tokens: int, prefix: str = "c") -> list[dict[str, Any]]:
    from mserve.bench.traces import make_trace
    from mserve.coordinator.client_core import generate_body

    trace = make_trace(modality, n, seed=3, photos=False)
    return [generate_body(f"{prefix}{i}", r.messages, True, max_tokens=max_tokens, ignore_eos=True)
            for i, r in enumerate(trace)]


def run_requests(fake: FakeCluster, bodies: list[dict[str, Any]], concurrency: int, pid: int) -> dict[str, Any]:
    before = dict(fake.msgs)
    fake.results = 0
    sent = 0
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    while fake.results < len(bodies):
        while sent < len(bodies) and sent - fake.results < concurrency:
            fake.submit(bodies[sent])
            sent += 1
        fake.turn(5)
        if time.perf_counter() - t0 > 300:
            raise TimeoutError("coordinator calibration run took over 5 minutes")
    wall = time.perf_counter() - t0
    time.sleep(0.05)
    cpu = _cpu_s(pid) - cpu0
    counts = {k: fake.msgs[k] - before[k] for k in fake.msgs}
    return {"requests": len(bodies), "wall_s": wall, "cpu_s": cpu, **counts}


def idle(fake: FakeCluster, seconds: float, pid: int) -> dict[str, float]:
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fake.turn(20)
    wall = time.perf_counter() - t0
    return {"workers": len(fake.workers), "wall_s": wall, "cpu_s": _cpu_s(pid) - cpu0}


def admission_s(model: str, modality: str, n: int = 60) -> float:
    """CPU of `admit()` alone per request (validate, hash images, read headers, template, tokenize),
    in this process: the part of a request's coordinator cost a stateless front end could take."""
    import statistics

    from mserve.common.prompt import PromptBuilder
    from mserve.coordinator.admission import Limits, admit
    from mserve.coordinator.settings import CoordinatorSettings
    from mserve.common.serde import decode, encode

    builder = PromptBuilder(model)
    limits = Limits(**CoordinatorSettings(model=model).limits())
    # As the coordinator gets them: msgpack frames decoded (image bytes as the wire carries them).
    bodies = [decode(encode(1, b))[1] for b in _bodies(model, modality, n, 33)]
    admit(builder, limits, dict(bodies[0]))
    times = []
    for b in bodies:
        t0 = time.process_time()
        admit(builder, limits, dict(b))
        times.append(time.process_time() - t0)
    return statistics.mean(times)


def measure_coordinator(model: str, scale: float = 1.0) -> dict[str, Any]:
    from mserve.common.redis_server import RedisServer, free_port

    n_img, n_txt = int(900 * scale), int(900 * scale)
    with RedisServer() as redis:
        cport, wport = free_port(), free_port()
        cmd = [sys.executable, "-m", "mserve.cli", "coordinator", "--model", model, "--bind",
               f"tcp://127.0.0.1:{cport}", "--worker-bind", f"tcp://127.0.0.1:{wport}", "--redis", redis.url]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        fake = FakeCluster(f"tcp://127.0.0.1:{cport}", f"tcp://127.0.0.1:{wport}", redis.url, model)
        try:
            for wid, role in (("encode-0", "encode"), ("prefill-0", "prefill"), ("decode-0", "decode")):
                fake.add_worker(wid, role)
            deadline = time.monotonic() + 120
            warm = _bodies(model, "image", 4, 2)
            # Wait until the coordinator is up and serving (its first answer), then warm it.
            fake.submit(warm[0])
            while fake.results < 1:
                fake.turn(50)
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("coordinator did not come up")
            run_requests(fake, warm[1:], 2, proc.pid)
            runs: list[dict[str, Any]] = []
            idles = [idle(fake, 4.0, proc.pid)]
            for modality, n, tokens, conc in (("image", n_img, 2, 8), ("image", n_img // 2, 33, 8),
                                              ("text", n_txt, 2, 8), ("image", n_img // 4, 33, 1),
                                              ("text", n_txt // 2, 33, 8)):
                r = run_requests(fake, _bodies(model, modality, n, tokens), conc, proc.pid)
                runs.append({"modality": modality, "max_tokens": tokens, "concurrency": conc, **r})
            for i in range(45):
                fake.add_worker(f"decode-x{i}", "decode")
            time.sleep(0.5)
            idles.append(idle(fake, 4.0, proc.pid))
        finally:
            fake.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    # Idle: CPU per second = base + per_worker * workers.
    (i3, i48) = idles
    per_worker_s = (i48["cpu_s"] / i48["wall_s"] - i3["cpu_s"] / i3["wall_s"]) / (i48["workers"] - i3["workers"])
    base_s = max(0.0, i3["cpu_s"] / i3["wall_s"] - per_worker_s * i3["workers"])
    # Runs: cpu - idle share = image_req * a + text_req * b + step_msgs * c + token_items * d.
    rows, ys = [], []
    for r in runs:
        idle_cpu = (base_s + per_worker_s * 3) * r["wall_s"]
        rows.append([r["requests"] * (r["modality"] == "image"), r["requests"] * (r["modality"] == "text"),
                     r["step_msgs"], r["token_items"]])
        ys.append(r["cpu_s"] - idle_cpu)
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(ys, float), rcond=None)
    img_req, txt_req, step_msg, item = (max(0.0, float(c)) for c in coef)
    msgs = sum(r["to_coordinator"] + r["from_coordinator"] for r in runs)
    ref = runs[1]
    return {
        "per_image_request_s": img_req, "per_text_request_s": txt_req, "per_step_msg_s": step_msg,
        "per_token_item_s": item, "per_worker_per_s": per_worker_s, "idle_s_per_s": base_s,
        "heartbeat_s": HEARTBEAT_S,
        "admission_image_s": admission_s(model, "image"), "admission_text_s": admission_s(model, "text"),
        "per_message_s": sum(r["cpu_s"] for r in runs) / msgs,
        "reference_image_33_tokens": {
            "messages_per_request": (ref["to_coordinator"] + ref["from_coordinator"]) / ref["requests"],
            "cpu_per_request_s": ref["cpu_s"] / ref["requests"]},
        "runs": runs, "idle": idles,
        "note": "fake workers (no model), real coordinator process + Redis; CPU from /proc (10 ms ticks)",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    p.add_argument("--json-out", default=None)
    p.add_argument("--shards", type=int, default=None,
                   help="instead: 1 and this many coordinator shards side by side (lab.coord_shards)")
    args = p.parse_args(argv)
    if args.shards is not None:
        from lab.coord_shards import main as shards_main

        return shards_main(["--model", args.model, "--shards", str(args.shards), "--scale", str(args.scale)]
                           + (["--json-out", args.json_out] if args.json_out else []))
    out = measure_coordinator(args.model, args.scale)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
