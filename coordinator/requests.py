"""The coordinator's per-request state machine: encode -> prefill -> decode (or `run` on a unified worker).

Pure code: no sockets, no Redis, no clock. Each step takes an event and `now` and returns the
messages to send, as ToClient / ToWorker records, in the order they must go out; the socket loop
(coordinator/server.py) sends them and reports a worker it cannot reach back as an `Unreachable` event. Admission (tokenizing) happens before: the machine receives an `Admitted`.
Redis-backed hints (who holds an image's embeddings, who holds a prompt's prefix blocks) come in
through a `Lookups` object; the default knows nothing, which only makes routing less cache-aware.

The machine is one Context (coordinator/context.py: the request table, the workers, the stage
queues, the counters, the step's Outbox) and the parts that act on it: StageReplies (a worker's stage
replies), a Lifecycle (re-runs, tokens out, ends) and a Dispatcher (queues and routes stages). Every
input is one event (coordinator/events.py) and one `step`, which runs in two phases:
  1. update: the event changes request state; a request ready for its next stage is queued
     (Dispatcher.advance), and what goes to clients (tokens, results, errors) and CANCELs are collected;
  2. schedule: waiting stages bind to the workers that can take them now, best class first, routed
     (Dispatcher.schedule), which returns the stage messages;
and returns the update's messages, then the schedule's, for the socket loop to send. One ENCODED reply,
from the socket to the PREFILL it triggers:
  Coordinator._on_worker_frames (server.py) -> RequestMachine.step (here) -> phase 1: `_on_worker`
  -> StageReplies.on_encoded records the embeddings, next stage PREFILL (Dispatcher.advance queues it)
  -> phase 2: Dispatcher.schedule routes it (routing.route_prefill) and builds it (records.stage_message)
  -> step returns it -> Coordinator._send (server.py) sends it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import uuid
from typing import Any, Callable

from mserve.common.protocol import ROLES, ErrorCode, Message, MsgType, ProtocolError
from mserve.common.protocol.to_coordinator import (TO_COORDINATOR, Encoded, Failed, Heartbeat, Prefilled, StepTokens,
                                                   WorkerInfo, WorkerLoad)
from mserve.common.protocol.to_worker import Cancel, Shutdown
from mserve.common.pruning import mismatch as pruning_mismatch
from mserve.coordinator.adaptive_pruning import AdaptivePruning
from mserve.coordinator.admission import Admitted
from mserve.coordinator.context import Context
from mserve.coordinator.dispatch import Dispatcher
from mserve.coordinator.drain import holds_work, waiting_by_role
from mserve.coordinator.events import Abort, Event, FromWorker, Reject, Submit, SwitchRoleTo, Tick, Unreachable
from mserve.coordinator.lifecycle import Lifecycle
from mserve.coordinator.records import (ACTIVE_STAGES, STAGE_ROLE, Lookups, NoLookups, Out,
                                        RequestState, RequestTable, Stage, ToClient, ToWorker, stage_message)
from mserve.coordinator.replies import StageReplies
from mserve.coordinator.role_switching import RoleSwitcher
from mserve.coordinator.settings import MachineSettings
from mserve.coordinator.shedding import choose_shed
from mserve.coordinator.single_flight import Leases, LocalLeases, SingleFlight
from mserve.coordinator.stage_queues import StageQueues
from mserve.coordinator.tracing import RequestTrace

__all__ = ["ACTIVE_STAGES", "Lookups", "MachineSettings", "NoLookups", "Out", "RequestMachine", "RequestState",
           "RequestTable", "Stage", "ToClient", "ToWorker", "stage_message"]

log = logging.getLogger("mserve.coordinator")


class RequestMachine:
    def __init__(self, settings: MachineSettings | None = None, *, lookups: Lookups | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, new_id: Callable[[], str] | None = None,
                 raise_errors: bool = False, seed: int | None = None, encode_leases: Leases | None = None,
                 shard_id: str = "coordinator", adaptive_pruning: AdaptivePruning | None = None) -> None:
        """`settings`: coordinator/settings.py (the coordinator passes its CoordinatorSettings); the rest
        is what the machine is given rather than configured with."""
        settings = settings if settings is not None else MachineSettings()
        self.ctx = ctx = Context(
            settings, random.Random(seed), detokenize or (lambda ids: ""), lookups or NoLookups(),
            SingleFlight(encode_leases or LocalLeases(), owner=shard_id) if settings.encode_single_flight else None,
            queues=StageQueues(aging_s=settings.class_aging_s))
        self.new_id = new_id or (lambda: uuid.uuid4().hex)
        self.raise_errors = raise_errors
        self._refused: dict[str, float | None] = {}  # worker -> the ratio it was refused for (logged once)
        self.adaptive = adaptive_pruning  # SLO-adaptive pruning: admission asks it a request's keep ratio
        self.dispatch = Dispatcher(ctx)
        self.life = Lifecycle(ctx, self.dispatch)
        self.replies = StageReplies(ctx, self.dispatch, self.life)
        # Role switches (an operator's, or the policy's with role_switching): coordinator/role_switching.py
        self.switcher = RoleSwitcher(ctx.members, ctx.requests, ctx.outbox, auto=settings.role_switching)

    # What the socket loop, status and tests read.
    settings = property(lambda self: self.ctx.settings)
    requests = property(lambda self: self.ctx.requests)
    members = property(lambda self: self.ctx.members)
    stats = property(lambda self: self.ctx.counters)

    # -- the step ----------------------------------------------------------------------------------------
    def step(self, event: Event, now: float) -> list[Out]:
        """Take one event at `now`: (1) update request state, (2) schedule and route the waiting stages.
        Returns what to send, in order: the update's messages, then the stages the schedule started."""
        self.ctx.outbox.begin(now)
        sends: list[Out] = []
        try:
            if isinstance(event, FromWorker):
                self._on_worker(event.worker_id, event.kind, event.payload)
            elif isinstance(event, Submit):
                self._submit(event.client, event.admitted)
            elif isinstance(event, Tick):
                self._tick()
            elif isinstance(event, Abort):
                self._abort(event.client, event.request_id)
            elif isinstance(event, Reject):
                self.ctx.counters.count("rejected")
                log.info("%s rejected: %s", event.request_id, event.message)
                self.ctx.outbox.error(event.client, event.request_id, event.code, event.message)
            elif isinstance(event, Unreachable):  # that attempt never ran: it costs the request nothing
                self.life.worker_died(event.worker_id, f"unreachable ({event.why})", undelivered=event.request_id)
            else:  # SwitchRoleTo, which `self.switcher.refusal` allowed
                self.switcher.start(event.worker_id, event.role, event.reason)
            if len(self.ctx.queues):
                sends = self.dispatch.schedule()
        except Exception:  # a message that validates but is wrong inside must not stop serving
            if self.raise_errors:
                raise
            log.exception("error while handling a message; the coordinator keeps serving")
        return self.ctx.outbox.take() + sends

    # One step per call, for callers holding the parts of an event.
    def submit(self, client: bytes, admitted: Admitted, *, now: float) -> list[Out]:
        return self.step(Submit(client, admitted), now)

    def reject(self, client: bytes, request_id: str | None, message: str, code: str = ErrorCode.BAD_REQUEST, *,
               now: float) -> list[Out]:
        return self.step(Reject(client, request_id, message, code), now)

    def abort(self, client: bytes, request_id: str, *, now: float) -> list[Out]:
        return self.step(Abort(client, request_id), now)

    def on_worker(self, worker_id: str, kind: MsgType, payload: Message | dict[str, Any], *, now: float) -> list[Out]:
        return self.step(FromWorker(worker_id, kind, payload), now)

    def switch_role(self, worker_id: str, role: str, reason: str, *, now: float) -> list[Out]:
        return self.step(SwitchRoleTo(worker_id, role, reason), now)

    def worker_unreachable(self, worker_id: str, why: str, request_id: str | None = None, *, now: float) -> list[Out]:
        return self.step(Unreachable(worker_id, why, request_id), now)

    def tick(self, *, now: float) -> list[Out]:
        return self.step(Tick(), now)

    # -- phase 1: what each event does to request state --------------------------------------------------
    def _submit(self, client: bytes, admitted: Admitted) -> None:
        """A GENERATE that passed admission: start it, or refuse a request_id already in flight."""
        if self.requests.find(client, admitted.request.request_id) is not None:
            self.ctx.outbox.error(client, admitted.request.request_id, ErrorCode.BAD_REQUEST,
                             f"request_id {admitted.request.request_id!r} is already in flight for this client")
            return
        if not self._make_room(client, admitted):
            return
        sampling = admitted.request.sampling
        if self.settings.token_report_every > 1 and sampling.temperature > 0 and sampling.seed is None:
            # Tokens the coordinator has not heard of yet may already be with the client: a re-run
            # must sample them again identically (seeds draw per token index, workers/sampler.py).
            sampling.seed = self.ctx.rng.getrandbits(62)
        st = RequestState(rid=self.new_id(), client=client, admitted=admitted, arrived=self.ctx.now)
        st.trace = RequestTrace.begin(parent=admitted.request.trace, request_id=st.rid, client_rid=st.client_rid,
                                      prompt_tokens=len(admitted.prompt_ids), visual_tokens=admitted.visual_tokens,
                                      images=len(admitted.images), latency_class=admitted.request.latency_class,
                                      admission_s=admitted.admission_s)
        self.requests.add(st)
        self.ctx.counters.count("admitted")
        self.ctx.counters.count("pruned_adaptive", admitted.keep_ratio is not None)
        self.ctx.counters.count("media_bytes_inline", admitted.inline_media_bytes)
        log.info("%s admitted: %d prompt tokens (%d visual, %d images), max_tokens %d", st.client_rid,
                 len(admitted.prompt_ids), admitted.visual_tokens, len(admitted.images),
                 admitted.request.sampling.max_tokens)
        self.life.restart(st, first=True)

    def _make_room(self, client: bytes, admitted: Admitted) -> bool:
        """Keep the requests waiting for a first token within bound: shed the lowest class (maybe the newcomer)."""
        waiting = [st for st in self.requests if not st.output_ids]
        limit = self.settings.max_waiting_requests
        if len(waiting) < limit:
            return True
        retry = self.ctx.first_tokens.retry_after_s(len(waiting))
        why = (f"overloaded: {len(waiting)} requests are waiting for their first token "
               f"(max_waiting_requests={limit}); retry after {retry:g}s")
        victim = choose_shed(waiting, admitted.request, self.ctx.now)
        self.ctx.counters.count("shed")
        if victim is None:
            log.info("%s shed: %s", admitted.request.request_id, why)
            self.ctx.outbox.error(client, admitted.request.request_id, ErrorCode.OVERLOADED, why, retry_after_s=retry)
            return False
        self.life.cancel_on_worker(victim)
        self.life.end(victim, error=(ErrorCode.OVERLOADED, why + " (a higher class arrived)"), retry_after_s=retry)
        return True

    def _abort(self, client: bytes, request_id: str) -> None:
        st = self.requests.find(client, request_id)
        if st is None:
            return
        self.life.cancel_on_worker(st)
        self.life.end(st, error=(ErrorCode.ABORTED, "aborted by the client"))

    def _on_worker(self, worker_id: str, kind: MsgType, payload: Message | dict[str, Any]) -> None:
        """A message from a worker (TO_COORDINATOR): as the socket parsed it, or a body checked here."""
        try:
            msg = payload if isinstance(payload, Message) else TO_COORDINATOR[kind].from_body(payload)
        except ProtocolError as exc:
            log.error("dropped a bad %s from worker %s: %s", kind.name, worker_id, exc)
            return
        if isinstance(msg, WorkerInfo):
            return self._on_ready(worker_id, msg)
        known = self.members.get(worker_id)
        if isinstance(msg, Heartbeat) and (known is None or not known.alive) and msg.registration() is not None:
            # A worker this coordinator never met (it restarted) or declared dead (it stalled): its
            # heartbeat carries its registration, so it rejoins without a restart of its own.
            return self._on_ready(worker_id, msg.registration())
        if known is None:
            log.warning("message %s from unregistered worker %s ignored", kind.name, worker_id)
            return
        self.members.seen(worker_id, self.ctx.now)
        if isinstance(msg, Heartbeat):
            self.members.apply_load(worker_id, msg.load)
        elif isinstance(msg, Encoded):
            self.replies.on_encoded(worker_id, msg)
            if self.members.is_alive(worker_id):  # not a late reply of one declared dead: it holds nothing here
                self.dispatch.images_encoded([im.hash for im in msg.images])
        elif isinstance(msg, Prefilled):
            self.replies.on_prefilled(worker_id, msg)
        elif isinstance(msg, StepTokens):
            for item in msg.items:
                self.replies.on_step_tokens(worker_id, item)
        elif isinstance(msg, Failed):
            self.replies.on_failed(worker_id, msg)
        else:  # BYE
            self.switcher.on_bye(worker_id, msg.switching_to)
            self.life.worker_died(worker_id, f"left to come back as {msg.switching_to}" if msg.switching_to
                                  else "said goodbye")

    def _tick(self) -> None:
        """Housekeeping: silent workers die, overdue stages re-run, waiting requests look for a worker."""
        now, timeout = self.ctx.now, self.settings.stage_timeout_s
        for worker_id, silence in self.members.silent(now, self.settings.dead_after_s):
            self.life.worker_died(worker_id, f"no heartbeat for {silence:.1f}s")
        roles_up = {w.role for w in self.members.routable()}
        for st in self.requests.values():
            if st.stage == Stage.QUEUED and STAGE_ROLE.get(st.next_stage) in roles_up:
                # Waiting only for room under max_stages_per_worker, which the stages open on those live
                # workers free (or re-run at their own deadlines): never a failure. A waiting request's
                # timeout counts from when no worker of its role is left.
                st.deadline = now + timeout
            elif now > st.deadline > 0:
                if st.stage == Stage.QUEUED:
                    self.life.end(st, error=(ErrorCode.NO_WORKERS, f"no worker could take the request's "
                                                                   f"{st.next_stage} stage within {timeout}s"))
                elif self.members.holds_queued(st.worker_id, st.rid):
                    # Merely queued at a live, busy worker: moving it elsewhere would only lose its place.
                    st.deadline = now + timeout
                else:
                    self.dispatch.uncharge(st)
                    self.life.restart(st, reason=f"{st.stage} stage timed out on {st.worker_id}")
        self.dispatch.poll_flights()
        self.switcher.tick()
        self._release_drained()
        if self.adaptive is not None:
            self.adaptive.observe(self.requests, self.members.routable(), now)

    def apply_loads(self, loads: dict[str, dict[str, Any]]) -> None:
        """Loads the workers published elsewhere (Redis), fresher than their last heartbeat. Only the
        numbers: whether a worker drains is its own word, in its heartbeats (another process under the
        same id on a shared Redis must not stop this one's routing)."""
        for worker_id, load in loads.items():
            self.members.apply_load(worker_id, dataclasses.replace(WorkerLoad.read(load), draining=None))

    def alive_workers(self) -> list[str]:
        return self.members.alive_ids()

    def status(self) -> dict[str, Any]:
        workers, roles = self.members.status()
        return {"workers": workers, "roles": roles, "requests_in_flight": len(self.requests),
                "stats": self.ctx.counters.snapshot(),
                "encode_parked": len(self.ctx.flights.parked) if self.ctx.flights else 0,
                "telemetry": self.ctx.telemetry.snapshot(), "queued": self.ctx.queues.counts(),
                "waiting": waiting_by_role(self.requests, {w.role for w in self.members.routable()},
                                           self.ctx.now),
                "role_switching": self.switcher.status(),
                **({"adaptive_pruning": self.adaptive.status()} if self.adaptive is not None else {})}

    def unknown(self, client: bytes, request_ids: list[str]) -> list[str]:
        """Which of a client's request ids this coordinator does not hold (it restarted, or they ended)."""
        return [r for r in request_ids if self.requests.find(client, r) is None]

    def _release_drained(self) -> None:
        """SHUTDOWN to each draining worker nothing depends on any more (coordinator/drain.py), once."""
        for worker_id in self.members.draining_to_release():
            if not holds_work(self.requests, worker_id):
                self.members.mark_shutdown_sent(worker_id)
                log.info("worker %s drained: no work of this coordinator left on it; SHUTDOWN sent", worker_id)
                self.ctx.outbox.to_worker(worker_id, Shutdown())

    def _on_ready(self, worker_id: str, info: WorkerInfo) -> None:
        role = info.role
        if role not in ROLES:
            log.error("worker %s announced unknown role %r; ignored", worker_id, role)
            return
        why = pruning_mismatch(worker_id, role, info.visual_token_pruning, self.settings.visual_token_pruning)
        if why is not None:  # its images would not fit the prompts admitted here: never give it work
            if self._refused.get(worker_id, -1.0) != info.visual_token_pruning:
                self._refused[worker_id] = info.visual_token_pruning
                log.error("%s", why)
            if self.members.is_alive(worker_id):  # restarted with another setting: its old self is gone
                self.life.worker_died(worker_id, "re-registered with another --visual-token-pruning")
            return
        self._refused.pop(worker_id, None)
        if self.members.is_alive(worker_id):  # a restarted process with the same id: its old work is lost
            self.life.worker_died(worker_id, "re-registered")
        for rid in self.members.join(worker_id, info, self.ctx.now):  # only stalled: stop its stale work
            self.ctx.outbox.to_worker(worker_id, Cancel(request_id=rid))
        self.switcher.on_join(worker_id, role)
        log.info("worker %s joined as %s (data plane %s)", worker_id, role, info.data_address)
