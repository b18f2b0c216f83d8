"""The simulated worker processes: encode, prefill and decode roles (see bench/lab/sim/cluster.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lab.sim.workload import SimRequest

if TYPE_CHECKING:
    from lab.sim.cluster import Cluster

LATENCY = ("interactive", "batch")
AGING_TOKENS_PER_S = 1000.0


@dataclass
class Req:
    r: SimRequest
    coord: Any = None
    sent_s: float = math.nan
    first_s: float = math.nan
    end_s: float = math.nan
    tokens: int = 0
    charged: tuple[Any, int] | None = None
    shed: bool = False  # answered `overloaded` at admission


class Worker:
    role = ""

    def __init__(self, cl: Cluster, wid: str) -> None:
        self.cl, self.wid = cl, wid
        self.inbox: list[Any] = []
        self.active = False

    def receive(self, msg: Any) -> None:
        self.inbox.append(msg)
        if not self.active:
            self.active = True
            self._turn()

    def _turn(self) -> None:
        if self.inbox:
            msgs, self.inbox = self.inbox, []
            cost = sum(self.accept_cost(m) for m in msgs)
            self.cl.cpu.run(cost, lambda: self._accepted(msgs), self.wid)
            return
        self._work()

    def _accepted(self, msgs: list[Any]) -> None:
        for m in msgs:
            self.accept(m)
        self._work()

    def _work(self) -> None:
        job = self.next_job()
        if job is None:
            if self.inbox:
                return self._turn()
            self.active = False
            return
        cost, done = job

        def finish() -> None:
            done()
            self._turn()

        self.cl.cpu.run(cost, finish, self.wid)

    # -- a role implements --------------------------------------------------------------------------
    def accept_cost(self, msg: Any) -> float:
        return 0.0

    def accept(self, msg: Any) -> None:
        raise NotImplementedError

    def next_job(self) -> tuple[float, Any] | None:
        raise NotImplementedError

    def report(self) -> tuple[int, int, int, int]:
        """(queue_len, running, free_blocks, total_blocks) as its heartbeat says."""
        return 0, 0, 0, 0


class EncodeWorker(Worker):
    role = "encode"

    def __init__(self, cl: Cluster, wid: str) -> None:
        super().__init__(cl, wid)
        self.queue: list[Req] = []

    def accept(self, q: Req) -> None:
        self.queue.append(q)

    def next_job(self) -> tuple[float, Any] | None:
        if not self.queue:
            return None
        order = sorted(self.queue, key=lambda q: (-q.r.priority, LATENCY.index(q.r.latency_class), q.sent_s))
        take, n = [], 0
        for q in order:
            k = len(q.r.image_sizes)
            if take and n + k > self.cl.costs.max_encode_images:
                break
            take.append(q)
            n += k
        chosen = set(map(id, take))
        self.queue = [q for q in self.queue if id(q) not in chosen]
        cost = self.cl.costs.encode_s([s for q in take for s in q.r.image_sizes])
        return cost, lambda: [self.cl.to_coord(q, ("encoded", q, self)) for q in take]

    def report(self) -> tuple[int, int, int, int]:
        return len(self.queue), 0, 0, 0


@dataclass
class Prompt:
    q: Req
    left: int
    added_s: float
    started: bool = False


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, cl: Cluster, wid: str) -> None:
        super().__init__(cl, wid)
        self.prompts: list[Prompt] = []

    def accept_cost(self, q: Req) -> float:
        if not q.r.has_images:
            return 0.0
        return self.cl.costs.transfer_s(self.cl.costs.embedding_bytes(len(q.r.image_sizes)))

    def accept(self, q: Req) -> None:
        self.prompts.append(Prompt(q, q.r.prompt_tokens, self.cl.loop.now))

    def next_job(self) -> tuple[float, Any] | None:
        if not self.prompts:
            return None
        now, costs = self.cl.loop.now, self.cl.costs
        order = sorted(self.prompts, key=lambda p: (-p.q.r.priority, LATENCY.index(p.q.r.latency_class),
                                                    p.left - AGING_TOKENS_PER_S * (now - p.added_s), p.added_s))
        budget, chunks = costs.chunk_tokens, []
        for p in order[: costs.max_num_seqs]:
            if budget <= 0:
                break
            n = min(p.left, budget)
            chunks.append((p, n))
            budget -= n
        tokens = sum(n for _, n in chunks)
        visual = sum(n * p.q.r.visual_tokens / p.q.r.prompt_tokens for p, n in chunks)
        done = [p for p, n in chunks if n == p.left]
        cost = costs.prefill_step_s(tokens, len(chunks), visual)
        cost += sum(costs.kv_handoff_s(p.q.r.prompt_tokens)[0] for p in done if p.q.r.max_tokens > 1)

        def finish() -> None:
            for p, n in chunks:
                p.left -= n
                p.started = True
            for p in done:
                self.prompts.remove(p)
                self.cl.to_coord(p.q, ("prefilled", p.q, self))

        return cost, finish

    def report(self) -> tuple[int, int, int, int]:
        waiting = sum(1 for p in self.prompts if not p.started)
        return waiting, len(self.prompts) - waiting, 0, 0


@dataclass
class Stream:
    q: Req
    ctx: int
    left: int


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, cl: Cluster, wid: str) -> None:
        super().__init__(cl, wid)
        self.running: list[Stream] = []
        self.total_blocks, self.block_size = cl.costs.kv_blocks

    def accept_cost(self, q: Req) -> float:
        return self.cl.costs.kv_handoff_s(q.r.prompt_tokens)[1]

    def accept(self, q: Req) -> None:
        self.running.append(Stream(q, q.r.prompt_tokens + 1, q.r.max_tokens - 1))

    def next_job(self) -> tuple[float, Any] | None:
        if not self.running:
            return None
        batch = self.running[: self.cl.costs.max_num_seqs]
        cost = self.cl.costs.decode_step_s(len(batch), sum(s.ctx for s in batch))

        def finish() -> None:
            by_coord: dict[int, list[tuple[Req, bool]]] = {}
            every = self.cl.token_report_every
            reported: set[int] = set()  # requests whose tokens the coordinator hears this step
            for s in batch:
                s.ctx += 1
                s.left -= 1
                by_coord.setdefault(s.q.coord.idx, []).append((s.q, s.left <= 0))
                if s.left <= 0 or (every and (s.q.r.max_tokens - 1 - s.left) % every == 0):
                    reported.add(id(s.q))
            self.running = [s for s in self.running if s.left > 0]
            for idx, items in by_coord.items():
                if not self.cl.stream_via_coordinator:
                    # Tokens go to the client; the coordinator hears the end (and, with token_report_every
                    # N, every Nth token: mserve's --token-report-every).
                    for q, finished in items:
                        if not finished:
                            self.cl.client.deliver(q, 1, False)
                    items = [(q, f) for q, f in items if id(q) in reported]
                    if not items:
                        continue
                coord = self.cl.coords[idx]
                self.cl.loop.after(self.cl.hop, coord.receive, ("step", items, self))

        return cost, finish

    def report(self) -> tuple[int, int, int, int]:
        used = sum(-(-s.ctx // self.block_size) for s in self.running)
        return 0, len(self.running), self.total_blocks - used, self.total_blocks
