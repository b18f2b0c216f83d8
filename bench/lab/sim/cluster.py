"""The simulated cluster: clients, coordinator(s) and encode / prefill / decode workers on a CPU pool.

Mirrors the real processes closely enough for capacity and latency:

* a worker is one process running its loop (workers/worker.py): take every queued control
  message (a prefill worker fetches the embeddings, a decode worker fetches and imports the KV, both
  inside this drain), then run one batch of work, and again; messages that arrive during a step wait;
* encode: one vision forward per batch of at most `max_encode_images` images, requests in the class
  order of coordinator/stage_queues.py (priority, latency class, arrival: what roles/encode.py
  `next_encode_batch` does);
* prefill: the worker's own Scheduler and BlockPool (workers/scheduler.py, workers/block_pool.py)
  decide every engine step: at most `chunk_tokens` prompt tokens, prompts in its policy order,
  admitted while the KV pool holds them; a finished prompt's KV is exported inside the step;
* decode: the same Scheduler and BlockPool run the continuous batch on the adopted KV (every
  running request one token a step; the pool's preemption and recompute when it runs dry), one
  STEP_TOKENS per coordinator per step; both pools are `kv_blocks` of the cost file;
* coordinator: one thread, a FIFO of messages, each paid with the calibrated CPU; it routes with
  coordinator/routing.py's own route_encode / route_prefill / route_decode over routing.WorkerView
  (no embedding cache or prefix hits here), and with `local_prefill_tokens` (the coordinator's
  setting, off by default there too) lends a prompt to a decode worker where route_local_prefill says
  so, which prefills it in its own steps and decodes on; `inflight` is the coordinator's own count,
  `queue_len` / `running` / `free_blocks` are the workers' reports, refreshed every heartbeat
  period (0.25 s);
* load shedding: a GENERATE arriving while `max_waiting_requests` admitted requests wait for
  their first token is answered `overloaded` (the real policy sheds the lowest class, which may
  be an older request; here always the newcomer);
* sharded coordinators (``coordinators=K``): requests are partitioned by request id; each shard
  routes with its own inflight counts and the shared reported loads, and pays the heartbeat and
  Redis cost of every worker;
* role switching (``role_policy``: the coordinator's --role-switching with those thresholds): see
  bench/lab/sim/roles.py.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lab.sim.core import CpuPool, Loop
from lab.sim.costs import Costs
from lab.sim.roles import RELOAD_S, RoleSwitching
from lab.sim.workers import DecodeWorker, EncodeWorker, PrefillWorker, Req, Worker
from lab.sim.workload import SimRequest
from mserve.common.policy import request_blocks
from mserve.coordinator.role_policy import RolePolicy
from mserve.coordinator.routing import (WorkerView, route_decode, route_encode, route_lend_adaptive, route_local_prefill,
                                       route_prefill)
from mserve.coordinator.settings import CoordinatorSettings

# How the per-request coordinator CPU is spread over the messages that carry it (stated assumption:
# admission, which tokenizes and hashes the images, dominates GENERATE).
SPLIT_IMAGE = {"generate": 0.6, "encoded": 0.15, "prefilled": 0.25}
SPLIT_TEXT = {"generate": 0.6, "prefilled": 0.4}


class Coordinator:
    def __init__(self, cl: Cluster, idx: int) -> None:
        self.cl, self.idx = cl, idx
        self.owner = f"coordinator-{idx}"
        # Two sockets, as server.py polls them: up to 256 worker messages, then up to 256 client
        # messages, and again (worker messages first: finishing work frees capacity).
        self.queues: dict[str, deque[Any]] = {"worker": deque(), "client": deque()}
        self.phase, self.burst = "worker", 0
        self.busy = False
        # The coordinator's view of each worker, as routing.py weighs it.
        self.views = {w.wid: WorkerView(w.wid, w.role) for w in cl.workers}
        self.by_role: dict[str, list[WorkerView]] = {}
        for v in self.views.values():
            self.by_role.setdefault(v.role, []).append(v)
        self.messages = 0
        self.step_items = 0  # token reports heard (one per request in a STEP_TOKENS)
        self.max_queue = 0
        self.window = (0.0, math.inf)  # busy_in: CPU of the messages started inside this span
        self.busy_in = 0.0
        self.rng = random.Random(idx)
        self.waiting = 0  # admitted requests without a first token (load shedding bounds them)
        self.lent = 0  # prompts lent to decode workers (the coordinator's `local_prefills`)

    def receive(self, msg: Any) -> None:
        q = self.queues["client" if msg[0] == "generate" else "worker"]
        q.append(msg)
        self.max_queue = max(self.max_queue, len(q))
        if not self.busy:
            self._next()

    def _pop(self) -> Any:
        other = "client" if self.phase == "worker" else "worker"
        if self.burst >= 256 or not self.queues[self.phase]:
            if self.queues[other] or not self.queues[self.phase]:
                self.phase, self.burst = other, 0
        q = self.queues[self.phase]
        if not q:
            return None
        self.burst += 1
        return q.popleft()

    def _next(self) -> None:
        msg = self._pop()
        if msg is None:
            self.busy = False
            return
        self.busy = True
        self.messages += 1
        cost = self._cost(msg)
        if self.window[0] <= self.cl.loop.now < self.window[1]:
            self.busy_in += cost
        self.cl.coord_cpu.run(cost, lambda: self._handle(msg), self.owner)

    def _cost(self, msg: Any) -> float:
        kind, costs = msg[0], self.cl.costs
        if kind == "step":
            return costs.coord_step_msg_s(len(msg[1]))
        if kind == "housekeeping":
            return msg[1]
        r = msg[1].r
        split = SPLIT_IMAGE if r.has_images else SPLIT_TEXT
        return costs.coord_request_s(r.has_images) * split.get(kind, 0.0)

    def _handle(self, msg: Any) -> None:
        kind = msg[0]
        if kind == "generate":
            q = msg[1]
            if self.waiting >= self.cl.max_waiting_requests:  # shedding.py, simplified: the newcomer goes
                q.shed = True
                self.cl.client.deliver(q, 0, True)
            else:
                self.waiting += 1
                self._dispatch(q, "encode" if q.r.has_images else "prefill")
        elif kind == "encoded":
            self._uncharge(msg[1])
            self._dispatch(msg[1], "prefill")
        elif kind == "prefilled":
            q = msg[1]
            self.waiting -= 1
            self._uncharge(q)
            self.cl.client.deliver(q, 1, q.r.max_tokens <= 1)
            if q.r.max_tokens > 1:
                self._dispatch(q, "decode")
        elif kind == "step":
            self.step_items += len(msg[1])
            for q, finished in msg[1]:
                if q.lent and not q.first_heard:  # a lent prompt's first token
                    q.first_heard = True
                    self.waiting -= 1
                    self._uncharge_tokens(q)  # its prompt is done there; the stage stays open
                if finished:
                    self._uncharge(q)
                if finished or self.cl.stream_via_coordinator:  # a progress report: the client has them
                    self.cl.client.deliver(q, 1, finished)
        elif kind == "housekeeping":
            for w in self.cl.workers:
                v = self.views[w.wid]
                v.queue_len, v.running, v.free_blocks, v.total_blocks = w.report()
        self._next()

    # -- routing: coordinator/routing.py itself ---------------------------------------------------
    def _dispatch(self, q: Req, role: str) -> None:
        views = self.by_role[role]
        if self.cl.routing == "p2c" and len(views) > 2:  # two random candidates, then the usual rule
            views = self.rng.sample(views, 2)
        tokens = 0
        if role == "encode":  # no embedding cache here: every image is a miss wherever it goes
            v = route_encode(views, [f"{q.r.rid}/{i}" for i in range(len(q.r.image_sizes))], {})
        elif role == "prefill":
            tokens = q.r.prompt_tokens
            v = route_prefill(views, tokens)
            v = self._lend(q, v) or v
        else:  # the blocks the whole reply needs, as coordinator/dispatch.py asks route_decode
            v = route_decode(views, request_blocks(q.r.prompt_tokens, q.r.max_tokens, self.cl.costs.kv_blocks[1]))
        v.inflight += 1
        v.inflight_tokens += tokens
        q.charged = (v, tokens)
        self.cl.loop.after(self.cl.hop, self.cl.worker[v.worker_id].receive, q)

    def _lend(self, q: Req, prefill: WorkerView) -> WorkerView | None:
        """A decode worker to prefill the prompt on (coordinator/dispatch.py `_local_prefill`), or None.
        Never while workers stream tokens to the client themselves, as there."""
        cl = self.cl
        if prefill is None or not (cl.local_prefill_tokens > 0 or cl.adaptive_lending) or not cl.stream_via_coordinator:
            return None
        need = request_blocks(q.r.prompt_tokens, q.r.max_tokens, cl.costs.kv_blocks[1])
        decoders = self.by_role.get("decode", [])
        v = (route_lend_adaptive(prefill, decoders, q.r.prompt_tokens, need) if cl.adaptive_lending
             else route_local_prefill(prefill, decoders, q.r.prompt_tokens, need, cl.local_prefill_tokens))
        if v is not None:
            q.lent = True
            self.lent += 1
        return v

    def _uncharge_tokens(self, q: Req) -> None:
        if q.charged:
            v, tokens = q.charged
            v.inflight_tokens = max(0, v.inflight_tokens - tokens)
            q.charged = (v, 0)

    def _uncharge(self, q: Req) -> None:
        if q.charged:
            v, tokens = q.charged
            v.inflight = max(0, v.inflight - 1)
            v.inflight_tokens = max(0, v.inflight_tokens - tokens)
            q.charged = None


class Client:
    """The load generator: sends at each arrival time (at most `max_concurrency` in flight), times tokens."""

    def __init__(self, cl: Cluster, requests: list[SimRequest], max_concurrency: int | None) -> None:
        self.cl = cl
        self.reqs = [Req(r) for r in sorted(requests, key=lambda r: (r.arrival_s, r.rid))]
        self.max_concurrency = max_concurrency
        self.waiting: deque[Req] = deque()
        self.in_flight = 0
        self.done = 0

    def start(self) -> None:
        for q in self.reqs:
            self.cl.loop.at(q.r.arrival_s, self._arrive, q)

    def _arrive(self, q: Req) -> None:
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            self.waiting.append(q)
            return
        self._send(q)

    def _send(self, q: Req) -> None:
        self.in_flight += 1
        q.sent_s = self.cl.loop.now
        q.coord = self.cl.coords[q.r.rid % len(self.cl.coords)]
        self.cl.loop.after(self.cl.hop, q.coord.receive, ("generate", q))

    def deliver(self, q: Req, tokens: int, finished: bool) -> None:
        """The coordinator sent TOKENS (and RESULT when finished): it lands one hop later."""
        self.cl.loop.after(self.cl.hop, self._landed, q, tokens, finished)

    def _landed(self, q: Req, tokens: int, finished: bool) -> None:
        if q.tokens == 0 and tokens:
            q.first_s = self.cl.loop.now
        q.tokens += tokens
        if finished:
            q.end_s = self.cl.loop.now
            self.in_flight -= 1
            self.done += 1
            if self.waiting:
                self._send(self.waiting.popleft())


@dataclass
class Cluster:
    costs: Costs
    encode: int = 1
    prefill: int = 1
    decode: int = 1
    coordinators: int = 1
    heartbeat_s: float = 0.25
    coordinator_cost_scale: float = 1.0  # 0: an ideal coordinator (no CPU), for reference runs
    # Design options of docs/scaling.md (today: True and 1.0): decode workers stream tokens to the
    # client themselves (the coordinator hears first token and end only); heartbeat/Redis cost scale.
    stream_via_coordinator: bool = True
    token_report_every: int = 0  # with stream_via_coordinator False: the coordinator also hears every Nth token
    heartbeat_cost_scale: float = 1.0
    admission_offload: bool = False  # admission (validate, hash, tokenize) done by stateless front ends
    max_waiting_requests: int = 256  # the coordinator's shedding bound (coordinator/settings.py)
    routing: str = "least"  # "least": routing.py over every worker; "p2c": the same rule over 2 sampled workers
    # The coordinator's lending backlog (coordinator/settings.py, its default): 0, never lend.
    local_prefill_tokens: int = CoordinatorSettings.model_fields["local_prefill_tokens"].default
    adaptive_lending: bool = CoordinatorSettings.model_fields["adaptive_lending"].default
    role_policy: RolePolicy | None = None  # None: no role switching (the coordinator's default)
    switch_reload_s: float = RELOAD_S
    loop: Loop = field(default_factory=Loop)

    def __post_init__(self) -> None:
        self.hop = self.costs.hop_s
        cores = self.costs.cores
        if cores is not None:  # what every worker process uses besides its stage work (loop, heartbeats)
            cores = max(0.1, cores - sum(n * self.costs.worker_overhead_cores(role) for role, n in
                                         (("encode", self.encode), ("prefill", self.prefill), ("decode", self.decode))))
        self.cpu = CpuPool(self.loop, cores, float(self.costs.data.get("cpu", {}).get("contention_factor", 1.0)))
        # On a shared host the coordinator competes for the same cores; elsewhere it has its own.
        self.coord_cpu = self.cpu if self.costs.cores is not None else CpuPool(self.loop, None)
        if self.coordinator_cost_scale != 1.0:
            self.costs = _scaled_coordinator(self.costs, self.coordinator_cost_scale)
        if self.admission_offload:
            self.costs = without_admission(self.costs)
        self.workers: list[Worker] = []
        for role, cls, n in (("encode", EncodeWorker, self.encode), ("prefill", PrefillWorker, self.prefill),
                             ("decode", DecodeWorker, self.decode)):
            self.workers += [cls(self, f"{role}-{i}") for i in range(n)]
        self.worker = {w.wid: w for w in self.workers}
        self.coords = [Coordinator(self, i) for i in range(self.coordinators)]
        self.client: Client | None = None
        self.roles = RoleSwitching(self, self.role_policy, self.switch_reload_s) if self.role_policy else None

    def to_coord(self, q: Req, msg: Any) -> None:
        self.loop.after(self.hop, q.coord.receive, msg)

    def _housekeeping(self) -> None:
        if self.client is not None and self.client.done == len(self.client.reqs):
            return
        cost = self.costs.coord_housekeeping_s(len(self.workers), self.heartbeat_s) * self.heartbeat_cost_scale
        for c in self.coords:
            c.receive(("housekeeping", cost))
        if self.roles is not None:
            self.roles.tick(self.loop.now)
        self.loop.after(self.heartbeat_s, self._housekeeping)

    def run(self, requests: list[SimRequest], max_concurrency: int | None = None,
            until_s: float = math.inf) -> list[Req]:
        self.client = Client(self, requests, max_concurrency)
        self.client.start()
        self._housekeeping()
        n = len(self.client.reqs)
        self.loop.run(until=until_s, stop=lambda: self.client.done == n)
        return self.client.reqs


def _scaled_coordinator(costs: Costs, scale: float) -> Costs:
    data = dict(costs.data)
    data["coordinator"] = {k: (v * scale if isinstance(v, (int, float)) and k.startswith(("per_", "idle")) else v)
                           for k, v in costs.data["coordinator"].items()}
    return Costs(data)


def without_admission(costs: Costs) -> Costs:
    """The coordinator's per-request CPU less admission, which front ends would do (docs/scaling.md)."""
    c = dict(costs.data["coordinator"])
    for kind in ("image", "text"):
        c[f"per_{kind}_request_s"] = max(0.0, c[f"per_{kind}_request_s"] - c.get(f"admission_{kind}_s", 0.0))
    return Costs({**costs.data, "coordinator": c})
