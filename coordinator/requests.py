"""The coordinator's per-request state machine: encode -> prefill -> decode (or `run` on a unified worker).

Pure code: no sockets, no Redis, no clock. Every entry point takes `now` and returns the messages to
send, as ToClient / ToWorker records, in the order they must go out; the socket loop
(coordinator/server.py) sends them and reports a worker it cannot reach back through
`worker_unreachable`. Admission (tokenizing) happens before: the machine receives an `Admitted`.
Redis-backed hints (who holds an image's embeddings, who holds a prompt's prefix blocks) come in
through a `Lookups` object; the default knows nothing, which only makes routing less cache-aware.

The machine is composed of collaborators it owns, each built with exactly what it uses: the
RequestTable (one record per request), Membership (the workers), a Dispatcher (queues and sends
stages), a Lifecycle (re-runs, tokens out, ends) and StageReplies (a worker's stage replies), all
appending to one Outbox per entry point. One ENCODED reply, from the socket to the next send:
  1. Coordinator._on_worker_frames (server.py) decodes the frames -> RequestMachine.on_worker
  2. RequestMachine.on_worker checks the body (Encoded) -> StageReplies.on_encoded (replies.py)
  3. StageReplies.on_encoded records the embeddings, next stage PREFILL -> Staging.advance (Dispatcher)
  4. the entry point ends (`_entry`) -> Dispatcher.dispatch_waiting routes the PREFILL, Outbox.to_worker
  5. Coordinator._send (server.py) sends what on_worker returned
"""

from __future__ import annotations

import functools
import logging
import random
import uuid
from typing import Any, Callable

from mserve.common.protocol import ROLES, ErrorCode, Message, MsgType, ProtocolError
from mserve.common.protocol.to_coordinator import (TO_COORDINATOR, Encoded, Failed, Heartbeat, Prefilled, StepTokens,
                                                   WorkerInfo)
from mserve.common.protocol.to_worker import Cancel, Shutdown
from mserve.common.policy import CLASS_AGING_S
from mserve.common.pruning import mismatch as pruning_mismatch
from mserve.coordinator.adaptive_pruning import AdaptivePruning
from mserve.coordinator.admission import Admitted
from mserve.coordinator.dispatch import Dispatcher
from mserve.coordinator.drain import holds_work, waiting_by_role
from mserve.coordinator.lifecycle import Lifecycle
from mserve.coordinator.membership import Membership
from mserve.coordinator.records import (ACTIVE_STAGES, STAGE_ROLE, Lookups, MachineSettings, NoLookups, Out, Outbox,
                                        RequestState, RequestTable, Stage, ToClient, ToWorker, stage_message)
from mserve.coordinator.replies import StageReplies
from mserve.coordinator.role_switching import RoleSwitcher
from mserve.coordinator.shedding import FirstTokenRate, choose_shed
from mserve.coordinator.single_flight import Leases, LocalLeases, SingleFlight
from mserve.coordinator.stage_queues import StageQueues
from mserve.coordinator.telemetry import Telemetry
from mserve.coordinator.tracing import RequestTrace

__all__ = ["ACTIVE_STAGES", "Lookups", "MachineSettings", "NoLookups", "Out", "RequestMachine", "RequestState",
           "RequestTable", "Stage", "ToClient", "ToWorker", "stage_message"]

log = logging.getLogger("mserve.coordinator")


def _entry(handler: Callable[..., None]) -> Callable[..., list[Out]]:
    """An entry point: set the clock, run the handler, send waiting stages to the workers that can take
    them now (whatever the handler did may have freed one), return what it queued to send."""

    @functools.wraps(handler)
    def wrapper(self: RequestMachine, *args: Any, now: float) -> list[Out]:
        self.outbox.begin(now)
        try:
            handler(self, *args)
            if len(self.queues):
                self.dispatch.dispatch_waiting()
        except Exception:  # a message that validates but is wrong inside must not stop serving
            if self.raise_errors:
                raise
            log.exception("error while handling a message; the coordinator keeps serving")
        return self.outbox.take()

    return wrapper


class RequestMachine:
    def __init__(self, *, stage_timeout_s: float = 60.0, dead_after_s: float = 5.0, max_attempts: int = 3,
                 max_waiting_requests: int = 256, lookups: Lookups | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 new_id: Callable[[], str] | None = None, raise_errors: bool = False,
                 visual_token_pruning: float | None = None, kv_hand_back: bool = False, max_stages_per_worker: int = 0,
                 class_aging_s: float = CLASS_AGING_S, spread_encode: bool = True, route_choices: int = 0,
                 seed: int | None = None, token_report_every: int = 1, encode_single_flight: bool = True,
                 encode_leases: Leases | None = None, shard_id: str = "coordinator",
                 prefix_skip: bool = True, local_prefill_tokens: int = 0, adaptive_pruning: AdaptivePruning | None = None,
                 adaptive_lending: bool = False, role_switching: bool = False) -> None:
        self.settings = MachineSettings(
            stage_timeout_s=stage_timeout_s, dead_after_s=dead_after_s, max_attempts=max_attempts,
            max_waiting_requests=max_waiting_requests, kv_hand_back=kv_hand_back,
            max_stages_per_worker=max_stages_per_worker, spread_encode=spread_encode, route_choices=route_choices,
            token_report_every=token_report_every, visual_token_pruning=visual_token_pruning, prefix_skip=prefix_skip,
            local_prefill_tokens=local_prefill_tokens, adaptive_lending=adaptive_lending)
        self.rng = random.Random(seed)
        self.first_tokens = FirstTokenRate()
        self.telemetry = Telemetry()
        self.new_id = new_id or (lambda: uuid.uuid4().hex)
        self.raise_errors = raise_errors
        self._refused: dict[str, float | None] = {}  # worker -> the ratio it was refused for (logged once)
        self.stats = {"admitted": 0, "rejected": 0, "completed": 0, "failed": 0, "reruns": 0, "shed": 0,
                      "spread_encodes": 0, "token_items": 0, "encode_deduplicated": 0,
                      "encodes_skipped_by_prefix": 0, "pruned_adaptive": 0, "local_prefills": 0,
                      "media_bytes_inline": 0}
        self.adaptive = adaptive_pruning  # SLO-adaptive pruning: admission asks it a request's keep ratio
        self.outbox = Outbox()
        self.members = Membership()
        self.requests = RequestTable()
        self.queues = StageQueues(aging_s=class_aging_s)
        self.dispatch = Dispatcher(self.requests, self.members, self.queues, lookups or NoLookups(), self.outbox,
                                   self.settings, self.stats, self.rng,
                                   SingleFlight(encode_leases or LocalLeases(), owner=shard_id)
                                   if encode_single_flight else None, telemetry=self.telemetry)
        self.life = Lifecycle(self.requests, self.members, self.dispatch, self.outbox, self.settings, self.stats,
                              self.first_tokens, self.telemetry, detokenize or (lambda ids: ""))
        self.replies = StageReplies(self.requests, self.members, self.dispatch, self.life, self.outbox, self.settings,
                                    self.stats)
        # Role switches (an operator's, or the policy's with role_switching): coordinator/role_switching.py
        self.switcher = RoleSwitcher(self.members, self.requests, self.outbox, auto=role_switching)

    # -- entry points: clients -----------------------------------------------------------------------
    @_entry
    def submit(self, client: bytes, admitted: Admitted) -> None:
        """A GENERATE that passed admission: start it, or refuse a request_id already in flight."""
        if self.requests.find(client, admitted.request.request_id) is not None:
            self.outbox.error(client, admitted.request.request_id, ErrorCode.BAD_REQUEST,
                             f"request_id {admitted.request.request_id!r} is already in flight for this client")
            return
        if not self._make_room(client, admitted):
            return
        sampling = admitted.request.sampling
        if self.settings.token_report_every > 1 and sampling.temperature > 0 and sampling.seed is None:
            # Tokens the coordinator has not heard of yet may already be with the client: a re-run
            # must sample them again identically (seeds draw per token index, workers/sampler.py).
            sampling.seed = self.rng.getrandbits(62)
        st = RequestState(rid=self.new_id(), client=client, admitted=admitted, arrived=self.outbox.now)
        st.trace = RequestTrace.begin(parent=admitted.request.trace, request_id=st.rid, client_rid=st.client_rid,
                                      prompt_tokens=len(admitted.prompt_ids), visual_tokens=admitted.visual_tokens,
                                      images=len(admitted.images), latency_class=admitted.request.latency_class,
                                      admission_s=admitted.admission_s)
        self.requests.add(st)
        self.stats["admitted"] += 1
        self.stats["pruned_adaptive"] += admitted.keep_ratio is not None
        self.stats["media_bytes_inline"] += admitted.inline_media_bytes
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
        retry = self.first_tokens.retry_after_s(len(waiting))
        why = (f"overloaded: {len(waiting)} requests are waiting for their first token "
               f"(max_waiting_requests={limit}); retry after {retry:g}s")
        victim = choose_shed(waiting, admitted.request, self.outbox.now)
        self.stats["shed"] += 1
        if victim is None:
            log.info("%s shed: %s", admitted.request.request_id, why)
            self.outbox.error(client, admitted.request.request_id, ErrorCode.OVERLOADED, why, retry_after_s=retry)
            return False
        self.life.cancel_on_worker(victim)
        self.life.end(victim, error=(ErrorCode.OVERLOADED, why + " (a higher class arrived)"), retry_after_s=retry)
        return True

    @_entry
    def reject(self, client: bytes, request_id: str | None, message: str,
               code: str = ErrorCode.BAD_REQUEST) -> None:
        """A GENERATE that failed admission (the request is invalid or over a limit)."""
        self.stats["rejected"] += 1
        log.info("%s rejected: %s", request_id, message)
        self.outbox.error(client, request_id, code, message)

    @_entry
    def abort(self, client: bytes, request_id: str) -> None:
        st = self.requests.find(client, request_id)
        if st is None:
            return
        self.life.cancel_on_worker(st)
        self.life.end(st, error=(ErrorCode.ABORTED, "aborted by the client"))

    # -- entry points: workers and time -----------------------------------------------------------------
    @_entry
    def on_worker(self, worker_id: str, kind: MsgType, payload: Message | dict[str, Any]) -> None:
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
        self.members.seen(worker_id, self.outbox.now)
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

    @_entry
    def switch_role(self, worker_id: str, role: str, reason: str) -> None:
        """Start a role switch `self.switcher.refusal` allowed (coordinator/role_switching.py)."""
        self.switcher.start(worker_id, role, reason)

    @_entry
    def worker_unreachable(self, worker_id: str, why: str, request_id: str | None = None) -> None:
        """A send to the worker failed (its socket is gone): it is dead. `request_id`: the request whose
        stage message was the one that failed; that attempt never ran, so it costs the request nothing."""
        self.life.worker_died(worker_id, f"unreachable ({why})", undelivered=request_id)

    @_entry
    def tick(self) -> None:
        """Housekeeping: silent workers die, overdue stages re-run, waiting requests look for a worker."""
        now, timeout = self.outbox.now, self.settings.stage_timeout_s
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
            self.members.apply_load(worker_id, {k: v for k, v in load.items() if k != "draining"})

    def alive_workers(self) -> list[str]:
        return self.members.alive_ids()

    def status(self) -> dict[str, Any]:
        workers, roles = self.members.status()
        return {"workers": workers, "roles": roles, "requests_in_flight": len(self.requests),
                "stats": dict(self.stats),
                "encode_parked": len(self.dispatch.flights.parked) if self.dispatch.flights else 0, "telemetry": self.telemetry.snapshot(), "queued": self.queues.counts(),
                "waiting": waiting_by_role(self.requests, {w.role for w in self.members.routable()},
                                           self.outbox.now),
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
                self.outbox.to_worker(worker_id, MsgType.SHUTDOWN, Shutdown().fields())

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
        for rid in self.members.join(worker_id, role, info.fields(), self.outbox.now):  # only stalled: stop its stale work
            self.outbox.to_worker(worker_id, MsgType.CANCEL, Cancel(request_id=rid).fields())
        self.switcher.on_join(worker_id, role)
        log.info("worker %s joined as %s (data plane %s)", worker_id, role, info.data_address)
