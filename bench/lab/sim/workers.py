"""The simulated worker processes: encode, prefill and decode roles (see bench/lab/sim/cluster.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lab.sim.workload import SimRequest
from mserve.common.policy import encode_batch
from mserve.workers.block_pool import BlockPool
from mserve.workers.scheduler import Scheduler
from mserve.workers.sequence import SamplingParams, Sequence
from mserve.workers.settings import WorkerSettings

if TYPE_CHECKING:
    from lab.sim.cluster import Cluster

# The engine's step budget besides the chunk cap: the worker's own default (workers/settings.py).
MAX_NUM_BATCHED_TOKENS = WorkerSettings.model_fields["max_num_batched_tokens"].default


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
    lent: bool = False  # its prompt was lent to a decode worker (prefilled and decoded there)
    first_heard: bool = False  # the coordinator has heard a lent prompt's first token


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
        # The encode worker's own rule (common/policy.py), over the queue in the order requests came.
        take, self.queue = encode_batch(self.queue, priority=lambda q: q.r.priority,
                                        latency_class=lambda q: q.r.latency_class,
                                        images=lambda q: len(q.r.image_sizes),
                                        max_images=self.cl.costs.max_encode_images)
        cost = self.cl.costs.encode_s([s for q in take for s in q.r.image_sizes])
        return cost, lambda: [self.cl.to_coord(q, ("encoded", q, self)) for q in take]

    def report(self) -> tuple[int, int, int, int]:
        return len(self.queue), 0, 0, 0


def _sequence(q: Req, prefill_only: bool) -> Sequence:
    """A request as the engine's scheduler sees it: only the token counts and the class matter here."""
    return Sequence(str(q.r.rid), [0] * q.r.prompt_tokens, SamplingParams(max_tokens=q.r.max_tokens),
                    priority=q.r.priority, latency_class=q.r.latency_class, prefill_only=prefill_only)


def _embeddings_fetch_s(cl: Cluster, q: Req) -> float:
    """Fetching a request's image embeddings from its encoder (none for a text-only one)."""
    if not q.r.has_images:
        return 0.0
    return cl.costs.transfer_s(cl.costs.embedding_bytes(len(q.r.image_sizes)))


def _scheduler(cl: Cluster) -> Scheduler:
    """The worker's own scheduler (workers/scheduler.py) and KV pool on the simulated clock. No prefix
    caching: the sim's prompts are placeholders, all alike, so every block would hit."""
    num_blocks, block_size = cl.costs.kv_blocks
    return Scheduler(BlockPool(num_blocks, block_size), max_num_seqs=cl.costs.max_num_seqs,
                     max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, cl.costs.chunk_tokens),
                     max_prefill_tokens=cl.costs.chunk_tokens, enable_prefix_caching=False,
                     clock=lambda: cl.loop.now)


class PrefillWorker(Worker):
    """Engine steps as workers/scheduler.py schedules them: prompts in its policy order, at most one
    chunk of prompt tokens a step, admitted only while the KV pool holds them."""

    role = "prefill"

    def __init__(self, cl: Cluster, wid: str) -> None:
        super().__init__(cl, wid)
        self.sched = _scheduler(cl)
        self.reqs: dict[str, Req] = {}

    @property
    def prompts(self) -> list[Sequence]:
        """Every prompt not yet prefilled (waiting or half done)."""
        return self.sched.waiting + self.sched.running

    def accept_cost(self, q: Req) -> float:
        return _embeddings_fetch_s(self.cl, q)

    def accept(self, q: Req) -> None:
        self.reqs[str(q.r.rid)] = q
        self.sched.add(_sequence(q, prefill_only=True))

    def next_job(self) -> tuple[float, Any] | None:
        chunks = self.sched.schedule()
        if not chunks:
            return None
        costs = self.cl.costs
        tokens = sum(c.num_tokens for c in chunks)
        visual = sum(c.num_tokens * self._req(c.seq).r.visual_tokens / c.seq.num_tokens for c in chunks)
        done = [c.seq for c in chunks if c.completes_sequence]
        cost = costs.prefill_step_s(tokens, len(chunks), visual)
        cost += sum(costs.kv_handoff_s(s.num_tokens)[0] for s in done if s.sampling.max_tokens > 1)

        def finish() -> None:
            for seq in self.sched.postprocess(chunks, [0] * len(done)):  # the engine's own bookkeeping
                if seq in self.sched.handing_off:  # exported with the step: the decode worker has them now
                    self.sched.free(seq)
                q = self.reqs.pop(seq.request_id)
                self.cl.to_coord(q, ("prefilled", q, self))

        return cost, finish

    def _req(self, seq: Sequence) -> Req:
        return self.reqs[seq.request_id]

    def report(self) -> tuple[int, int, int, int]:
        return len(self.sched.waiting), len(self.sched.running), 0, 0


class DecodeWorker(Worker):
    """The continuous batch as workers/scheduler.py runs it on an adopted request's KV: every running
    request one token a step, its blocks grown from the pool, the latest preempted (and recomputed
    later) when the pool runs dry. An import the pool cannot hold waits here for blocks to free; the
    real worker fails it (retryable) and the coordinator sends it again. A prompt lent to it
    (roles/decode.py) joins the scheduler whole and is prefilled in its steps, as a recompute is."""

    role = "decode"

    def __init__(self, cl: Cluster, wid: str) -> None:
        super().__init__(cl, wid)
        self.sched = _scheduler(cl)
        self.reqs: dict[str, Req] = {}
        self.imports: list[Req] = []  # KV that did not fit yet

    @property
    def running(self) -> list[Any]:
        """Every request this worker still holds, adopted or not."""
        return self.sched.running + self.sched.waiting + self.imports

    def accept_cost(self, q: Req) -> float:
        if q.lent:  # the images' embeddings, as a prefill worker fetches them
            return _embeddings_fetch_s(self.cl, q)
        return self.cl.costs.kv_handoff_s(q.r.prompt_tokens)[1]

    def accept(self, q: Req) -> None:
        if q.lent:
            self.reqs[str(q.r.rid)] = q
            self.sched.add(_sequence(q, prefill_only=False))
        else:
            self.imports.append(q)

    def _adopt(self) -> None:
        """Engine.import_kv: the prompt's blocks and its first token, one token left to compute."""
        pool = self.sched.pool
        while self.imports:
            seq = _sequence(self.imports[0], prefill_only=False)
            seq.output_ids = [0]
            if not pool.can_allocate(pool.blocks_needed(seq.num_tokens)):
                return
            pool.allocate(seq.block_table, seq.num_tokens)
            seq.num_computed_tokens = len(seq.prompt_ids)
            self.reqs[seq.request_id] = self.imports.pop(0)
            self.sched.add_running(seq)

    def next_job(self) -> tuple[float, Any] | None:
        self._adopt()
        chunks = self.sched.schedule()
        if not chunks:
            return None
        costs = self.cl.costs
        steps, recompute = [], []  # a decode token, or a prompt (lent, or recomputed after a preemption)
        for c in chunks:
            (steps if c.num_tokens == 1 and c.start >= len(c.seq.prompt_ids) else recompute).append(c)
        cost = costs.decode_step_s(len(steps), sum(c.seq.num_tokens for c in steps)) if steps else 0.0
        if recompute:
            visual = sum(c.num_tokens * self.reqs[c.seq.request_id].r.visual_tokens / c.seq.num_tokens
                         for c in recompute)
            cost += costs.prefill_step_s(sum(c.num_tokens for c in recompute), len(recompute), visual)
        return cost, lambda: self._stepped(chunks)

    def _stepped(self, chunks: list[Any]) -> None:
        by_coord: dict[int, list[tuple[Req, bool]]] = {}
        every = self.cl.token_report_every
        reported: set[int] = set()  # requests whose tokens the coordinator hears this step
        sampled = sum(c.completes_sequence for c in chunks)
        for seq in self.sched.postprocess(chunks, [0] * sampled):  # the engine's own bookkeeping
            q = self.reqs[seq.request_id]
            finished = seq.finish_reason is not None
            if finished:  # postprocess freed its blocks
                del self.reqs[seq.request_id]
            by_coord.setdefault(q.coord.idx, []).append((q, finished))
            if finished or (every and (len(seq.output_ids) - 1) % every == 0):
                reported.add(id(q))
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

    def report(self) -> tuple[int, int, int, int]:
        pool = self.sched.pool
        return len(self.sched.waiting) + len(self.imports), len(self.sched.running), pool.num_free_blocks, pool.num_blocks
