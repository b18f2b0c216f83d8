"""The two processes of lab.transfer_bench: a sender that times every path, and a receiver.

Every remote path is timed from the sender starting its side (publish, export, send) to the
receiver holding usable tensors, both ends read from ``time.perf_counter`` (CLOCK_MONOTONIC,
one clock for the whole host). One hand-off is in flight at a time, and the sender waits for
its ack before the next, so shm runs on recycled (warm) segments, as in steady state.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch

KV_SHAPE = (8, 2, 38, 16, 4, 64)  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
BIG_BLOCKS = 256  # 64 MiB of the same layout
POOL_BLOCKS = 256
BACKENDS = ("shm", "tcp", "torch")
SIZES = {"kv": KV_SHAPE, "big": KV_SHAPE[:2] + (BIG_BLOCKS,) + KV_SHAPE[3:]}
ZMQ_BUF = 4 << 20  # SNDBUF/RCVBUF variant; Linux caps it at net.core.[wr]mem_max (4 MiB here)
DST_IDS = list(range(100, 100 + KV_SHAPE[2]))


def nbytes(shape: tuple[int, ...]) -> int:
    n = 4  # float32
    for d in shape:
        n *= d
    return n


def kv_pool() -> Any:
    from mserve.workers.paged_attention import KVCache

    layers, _, _, heads, block, dim = KV_SHAPE
    return KVCache(layers, POOL_BLOCKS, heads, block, dim)


def _setup(threads: int) -> None:
    from mserve.common.perf import tune_malloc

    tune_malloc()  # as every worker process does
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- receiver


def receiver(conn: Any, threads: int) -> None:
    import zmq

    from mserve.common.transfer import TransferEngine

    _setup(threads)
    ctx = zmq.Context()
    pairs = {}
    for name, address, buf in conn.recv():  # the sender's raw zmq endpoints
        pairs[name] = ctx.socket(zmq.PAIR)
        if buf:
            pairs[name].setsockopt(zmq.RCVBUF, buf)
            pairs[name].setsockopt(zmq.SNDBUF, buf)
        pairs[name].connect(address)
    raw = socket.create_connection(conn.recv())
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = {k: bytearray(nbytes(s)) for k, s in SIZES.items()}
    pool = kv_pool()
    with TransferEngine("bench-rx") as rx:
        while (msg := conn.recv())[0] != "stop":
            kind, *args = msg
            if kind == "ping":
                conn.send(time.perf_counter())
            elif kind == "zmq":
                pairs[args[0]].recv_multipart(copy=False)
                conn.send(time.perf_counter())
            elif kind == "socket":  # into a pre-allocated buffer: the kernel's copies only
                view, got = memoryview(sink[args[0]]), 0
                while got < len(view):
                    got += raw.recv_into(view[got:])
                conn.send(time.perf_counter())
            else:  # "fetch" / "import": the descriptor's wire dict, as the control plane carries it
                desc, copy = args
                handle = None if copy else rx.fetch_view(desc, timeout_s=30)
                tensors = rx.fetch(desc, timeout_s=30) if copy else handle.tensors
                if kind == "import":
                    pool.import_blocks(DST_IDS, tensors["kv"])
                t1 = time.perf_counter()
                if handle is not None:
                    handle.release()
                del tensors
                conn.send(t1)
    raw.close()
    for p in pairs.values():
        p.close(linger=0)
    ctx.term()


# --------------------------------------------------------------------------- sender


class Sender:
    """Owns the payloads and the wires; each method times one run of one path (seconds)."""

    def __init__(self, conn: Any, tx: Any, zmq_ctx: Any) -> None:
        import zmq

        self.conn, self.tx = conn, tx
        self.n = 0
        g = torch.Generator().manual_seed(0)
        self.payloads = {k: {"kv": torch.randn(s, generator=g)} for k, s in SIZES.items()}
        self.flat = {k: p["kv"].view(-1).view(torch.uint8) for k, p in self.payloads.items()}
        self.dst = {k: torch.empty_like(f) for k, f in self.flat.items()}
        self.src_pool, self.dst_pool = kv_pool(), kv_pool()
        for t in self.src_pool.k + self.src_pool.v:
            t.normal_(generator=g)
        self.src_ids = torch.randperm(POOL_BLOCKS, generator=g)[: KV_SHAPE[2]].tolist()
        self.pairs, endpoints = {}, []
        for name, buf in (("zmq", 0), ("zmq-buf", ZMQ_BUF)):
            sock = zmq_ctx.socket(zmq.PAIR)
            if buf:
                sock.setsockopt(zmq.SNDBUF, buf)
                sock.setsockopt(zmq.RCVBUF, buf)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.pairs[name] = sock
            endpoints.append((name, f"tcp://127.0.0.1:{port}", buf))
        conn.send(endpoints)
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(listener.getsockname())
        self.raw, _ = listener.accept()
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.close()

    def close(self) -> None:
        self.raw.close()
        for p in self.pairs.values():
            p.close(linger=0)

    def _tid(self) -> str:
        self.n += 1
        return f"bench-{self.n}"

    def _remote(self, t0: float, *msg: Any) -> float:
        self.conn.send(msg)
        t1 = self.conn.recv()
        deadline = time.monotonic() + 10
        while self.tx.pending() and time.monotonic() < deadline:
            time.sleep(0.0002)
        return t1 - t0

    def ping(self) -> float:
        t0 = time.perf_counter()
        self.conn.send(("ping",))
        return self.conn.recv() - t0

    def copy(self, size: str) -> float:
        t0 = time.perf_counter()
        self.dst[size].copy_(self.flat[size])
        return time.perf_counter() - t0

    def zmq(self, size: str, wire: str, frames: int = 1) -> float:
        data = memoryview(self.flat[size].numpy())
        step = -(-len(data) // frames)
        parts = [data[i : i + step] for i in range(0, len(data), step)]
        self.conn.send(("zmq", wire))
        t0 = time.perf_counter()
        self.pairs[wire].send_multipart(parts, copy=False)
        return self.conn.recv() - t0

    def socket(self, size: str) -> float:
        self.conn.send(("socket", size))
        t0 = time.perf_counter()
        self.raw.sendall(memoryview(self.flat[size].numpy()))
        return self.conn.recv() - t0

    def transfer(self, size: str, backend: str, copy: bool) -> float:
        t0 = time.perf_counter()
        desc = self.tx.publish(self._tid(), self.payloads[size], backend=backend)
        return self._remote(t0, "fetch", desc.to_wire(), copy)

    def pool_local(self) -> float:
        t0 = time.perf_counter()
        self.dst_pool.import_blocks(DST_IDS, self.src_pool.export_blocks(self.src_ids))
        return time.perf_counter() - t0

    def pool_remote(self, backend: str, copy: bool, in_place: bool) -> float:
        t0 = time.perf_counter()
        if in_place:  # the prefill worker's path: gather the blocks straight into the transfer
            spec = {"kv": (self.src_pool.export_shape(len(self.src_ids)), self.src_pool.dtype)}
            alloc = self.tx.alloc(spec, backend=backend)
            self.src_pool.export_blocks(self.src_ids, out=alloc.tensors["kv"])
            desc = self.tx.publish_allocated(self._tid(), alloc)
        else:
            kv = self.src_pool.export_blocks(self.src_ids)
            desc = self.tx.publish(self._tid(), {"kv": kv}, backend=backend)
        return self._remote(t0, "import", desc.to_wire(), copy)

    def paths(self) -> dict[tuple[str, str], Callable[[], float]]:
        """(table, row) -> run. Rows of the "kv"/"big" tables are a/c/d paths of that payload."""
        paths: dict[tuple[str, str], Callable[[], float]] = {("misc", "pipe"): self.ping}
        for size in SIZES:
            paths[(size, "(c) dst.copy_(src), in-process")] = lambda s=size: self.copy(s)
            for b in BACKENDS:
                for copy in (True, False):
                    name = f"(a) {b}, {'fetch (copy=True)' if copy else 'fetch_view (zero-copy)'}"
                    paths[(size, name)] = lambda s=size, b=b, c=copy: self.transfer(s, b, c)
            paths[(size, "(d) raw zmq PAIR, 1 frame")] = lambda s=size: self.zmq(s, "zmq")
            paths[(size, "(d) raw zmq PAIR, 4 frames")] = lambda s=size: self.zmq(s, "zmq", 4)
            paths[(size, "(d) raw zmq PAIR, SNDBUF/RCVBUF 4 MiB")] = (
                lambda s=size: self.zmq(s, "zmq-buf"))
            paths[(size, "(d) raw TCP socket (no zmq)")] = lambda s=size: self.socket(s)
        paths[("pool", "in-process export + import")] = self.pool_local
        paths[("pool", "shm: alloc + export in place, fetch_view")] = (
            lambda: self.pool_remote("shm", False, True))
        paths[("pool", "shm: export, publish (copy), fetch (copy)")] = (
            lambda: self.pool_remote("shm", True, False))
        paths[("pool", "tcp: export, publish, fetch")] = lambda: self.pool_remote("tcp", False, False)
        paths[("pool", "torch: alloc + export in place, fetch")] = (
            lambda: self.pool_remote("torch", False, True))
        return paths


def run_pair(workers: list[Any], parent: Any, what: str, timeout_s: float = 600.0) -> Any:
    """Start the sender/receiver processes, return what the parent end of the pipe receives, and always
    reap them (killed if they outlive the result by 30 s)."""
    for p in workers:
        p.start()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"{what} did not finish in {timeout_s / 60:g} minutes")
        return parent.recv()
    finally:
        for p in workers:
            p.join(30)
            if p.is_alive():
                p.kill()


def sender(conn: Any, rx_conn: Any, warmup: int, iters: int, passes: int, threads: int) -> None:
    import zmq

    from mserve.common.transfer import TransferEngine

    _setup(threads)
    ctx = zmq.Context()
    with TransferEngine("bench-tx") as tx:
        s = Sender(rx_conn, tx, ctx)
        paths = s.paths()
        times: dict[tuple[str, str], list[float]] = {k: [] for k in paths}
        # Short blocks per path (warm-up, then timed runs back to back: steady state, caches as
        # warm as the path itself leaves them), the blocks repeated in turn so that the host's
        # noise lands on every path alike.
        per_block = -(-iters // passes)
        for _ in range(passes):
            for key, run in paths.items():
                for _ in range(warmup):
                    run()
                times[key] += [run() for _ in range(per_block)]
        rx_conn.send(("stop",))
        pool = tx.stats()["shm_pool"]
        s.close()
    ctx.term()
    conn.send({"times": times, "pool": pool, "threads": torch.get_num_threads()})
