"""The coordinator's per-request state machine: encode -> prefill -> decode (or `run` on a unified worker).

Pure code: no sockets, no Redis, no clock. Every entry point takes `now` and returns the messages to
send, as ToClient / ToWorker records, in the order they must go out; the socket loop
(coordinator/server.py) sends them and reports a worker it cannot reach back through
`worker_unreachable`. Admission (tokenizing) happens before: the machine receives an `Admitted`.
Redis-backed hints (who holds an image's embeddings, who holds a prompt's prefix blocks) come in
through a `Lookups` object; the default knows nothing, which only makes routing less cache-aware.
"""

from __future__ import annotations

import functools
import logging
import random
import uuid
from typing import Any, Callable

from mserve.common.protocol import ROLES, ErrorCode, Message, MsgType, ProtocolError
from mserve.common.protocol.client import Error, Tokens
from mserve.common.protocol.to_coordinator import (TO_COORDINATOR, Encoded, Failed, Heartbeat, Prefilled, StepTokens,
                                                   WorkerInfo)
from mserve.common.pruning import mismatch as pruning_mismatch
from mserve.coordinator.admission import Admitted
from mserve.coordinator.drain import holds_work, waiting_by_role
from mserve.coordinator.membership import Membership
from mserve.coordinator.replies import StageReplies
from mserve.coordinator.records import (ACTIVE_STAGES, STAGE_ROLE, Lookups, NoLookups, Out, RequestState, Stage,
                                        ToClient, ToWorker, result_body, stage_message)
from mserve.coordinator.shedding import FirstTokenRate, choose_shed
from mserve.coordinator.dispatch import Dispatch
from mserve.coordinator.stage_queues import StageQueues
from mserve.coordinator.telemetry import Telemetry

__all__ = ["ACTIVE_STAGES", "Lookups", "NoLookups", "Out", "RequestMachine", "RequestState", "Stage", "ToClient",
           "ToWorker", "stage_message"]

log = logging.getLogger("mserve.coordinator")


def _entry(handler: Callable[..., None]) -> Callable[..., list[Out]]:
    """An entry point: set the clock, run the handler, send waiting stages to the workers that can take
    them now (whatever the handler did may have freed one), return what it queued to send."""

    @functools.wraps(handler)
    def wrapper(self: RequestMachine, *args: Any, now: float) -> list[Out]:
        self._now, self._out = now, []
        try:
            handler(self, *args)
            if len(self.queues):
                self._dispatch_waiting()
        except Exception:  # a message that validates but is wrong inside must not stop serving
            if self.raise_errors:
                raise
            log.exception("error while handling a message; the coordinator keeps serving")
        out, self._out = self._out, []
        return out

    return wrapper


class RequestMachine(StageReplies, Dispatch):
    def __init__(self, *, stage_timeout_s: float = 60.0, dead_after_s: float = 5.0, max_attempts: int = 3,
                 max_waiting_requests: int = 256, lookups: Lookups | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 new_id: Callable[[], str] | None = None, raise_errors: bool = False,
                 visual_token_pruning: float | None = None, kv_hand_back: bool = False, max_stages_per_worker: int = 0,
                 class_aging_s: float = 10.0, spread_encode: bool = True, route_choices: int = 0,
                 seed: int | None = None, token_report_every: int = 1) -> None:
        self.stage_timeout_s = stage_timeout_s
        self.dead_after_s = dead_after_s
        self.max_attempts = max_attempts
        self.max_waiting_requests = max_waiting_requests
        self.kv_hand_back = kv_hand_back  # DECODE asks for the reply's KV back (replies.py relays it to prefill)
        # Stages open at once on one encode, prefill or unified worker (0: no cap); the rest wait in
        # `queues`, best class first, and bind to whichever worker frees first.
        self.max_stages_per_worker = max_stages_per_worker
        self.spread_encode = spread_encode  # share a multi-image ENCODE with idle encoders (dispatch.py)
        # 0: score every worker of the role; N: N drawn at random plus the cache holders (dispatch.py)
        self.route_choices = route_choices
        self.rng = random.Random(seed)
        # > 1: decode and unified workers report tokens this often, streaming them to clients that
        # gave a token sink themselves (records.token_route); 1: every step, all through here.
        self.token_report_every = token_report_every
        self.first_tokens = FirstTokenRate()
        self.telemetry = Telemetry()
        self.lookups: Lookups = lookups or NoLookups()
        self.detokenize = detokenize or (lambda ids: "")
        self.new_id = new_id or (lambda: uuid.uuid4().hex)
        self.raise_errors = raise_errors
        # Admission counts placeholders at this keep ratio: encoding workers must prune to the same one.
        self.visual_token_pruning = visual_token_pruning
        self._refused: dict[str, float | None] = {}  # worker -> the ratio it was refused for (logged once)
        self.members = Membership()
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.queues = StageQueues(aging_s=class_aging_s)
        self.stats = {"admitted": 0, "rejected": 0, "completed": 0, "failed": 0, "reruns": 0, "shed": 0,
                      "spread_encodes": 0, "token_items": 0}
        self._now = 0.0
        self._out: list[Out] = []

    # -- entry points: clients -----------------------------------------------------------------------
    @_entry
    def submit(self, client: bytes, admitted: Admitted) -> None:
        """A GENERATE that passed admission: start it, or refuse a request_id already in flight."""
        key = (client, admitted.request.request_id)
        if key in self.by_client:
            self._error(client, admitted.request.request_id, ErrorCode.BAD_REQUEST,
                        f"request_id {admitted.request.request_id!r} is already in flight for this client")
            return
        if not self._make_room(client, admitted):
            return
        sampling = admitted.request.sampling
        if self.token_report_every > 1 and sampling.temperature > 0 and sampling.seed is None:
            # Tokens the coordinator has not heard of yet may already be with the client: a re-run
            # must sample them again identically (seeds draw per token index, workers/sampler.py).
            sampling.seed = self.rng.getrandbits(62)
        st = RequestState(rid=self.new_id(), client=client, admitted=admitted, arrived=self._now)
        self.requests[st.rid] = st
        self.by_client[key] = st.rid
        self.stats["admitted"] += 1
        log.info("%s admitted: %d prompt tokens (%d visual, %d images), max_tokens %d", st.client_rid,
                 len(admitted.prompt_ids), admitted.visual_tokens, len(admitted.images),
                 admitted.request.sampling.max_tokens)
        self._restart(st, first=True)

    def _make_room(self, client: bytes, admitted: Admitted) -> bool:
        """Keep the requests waiting for a first token within bound: shed the lowest class (maybe the newcomer)."""
        waiting = [st for st in self.requests.values() if not st.output_ids]
        if len(waiting) < self.max_waiting_requests:
            return True
        retry = self.first_tokens.retry_after_s(len(waiting))
        why = (f"overloaded: {len(waiting)} requests are waiting for their first token "
               f"(max_waiting_requests={self.max_waiting_requests}); retry after {retry:g}s")
        victim = choose_shed(waiting, admitted.request, self._now)
        self.stats["shed"] += 1
        if victim is None:
            log.info("%s shed: %s", admitted.request.request_id, why)
            self._error(client, admitted.request.request_id, ErrorCode.OVERLOADED, why, retry_after_s=retry)
            return False
        self._cancel_on_worker(victim)
        self._end(victim, error=(ErrorCode.OVERLOADED, why + " (a higher class arrived)"), retry_after_s=retry)
        return True

    @_entry
    def reject(self, client: bytes, request_id: str | None, message: str,
               code: str = ErrorCode.BAD_REQUEST) -> None:
        """A GENERATE that failed admission (the request is invalid or over a limit)."""
        self.stats["rejected"] += 1
        log.info("%s rejected: %s", request_id, message)
        self._error(client, request_id, code, message)

    @_entry
    def abort(self, client: bytes, request_id: str) -> None:
        rid = self.by_client.get((client, request_id))
        if rid is None:
            return
        st = self.requests[rid]
        self._cancel_on_worker(st)
        self._end(st, error=(ErrorCode.ABORTED, "aborted by the client"))

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
        self.members.seen(worker_id, self._now)
        if isinstance(msg, Heartbeat):
            self.members.apply_load(worker_id, msg.load)
        elif isinstance(msg, Encoded):
            self._on_encoded(worker_id, msg)
        elif isinstance(msg, Prefilled):
            self._on_prefilled(worker_id, msg)
        elif isinstance(msg, StepTokens):
            for item in msg.items:
                self._on_step_tokens(worker_id, item)
        elif isinstance(msg, Failed):
            self._on_failed(worker_id, msg)
        else:  # BYE
            self._worker_died(worker_id, "said goodbye")

    @_entry
    def worker_unreachable(self, worker_id: str, why: str, request_id: str | None = None) -> None:
        """A send to the worker failed (its socket is gone): it is dead. `request_id`: the request whose
        stage message was the one that failed; that attempt never ran, so it costs the request nothing."""
        self._worker_died(worker_id, f"unreachable ({why})", undelivered=request_id)

    @_entry
    def tick(self) -> None:
        """Housekeeping: silent workers die, overdue stages re-run, waiting requests look for a worker."""
        for worker_id, silence in self.members.silent(self._now, self.dead_after_s):
            self._worker_died(worker_id, f"no heartbeat for {silence:.1f}s")
        roles_up = {w.role for w in self.members.routable()}
        for st in list(self.requests.values()):
            if st.stage == Stage.QUEUED and STAGE_ROLE.get(st.next_stage) in roles_up:
                # Waiting only for room under max_stages_per_worker, which the stages open on those live
                # workers free (or re-run at their own deadlines): never a failure. A waiting request's
                # timeout counts from when no worker of its role is left.
                st.deadline = self._now + self.stage_timeout_s
            elif self._now > st.deadline > 0:
                if st.stage == Stage.QUEUED:
                    self._end(st, error=(ErrorCode.NO_WORKERS, f"no worker could take the request's "
                                                               f"{st.next_stage} stage within {self.stage_timeout_s}s"))
                elif self.members.holds_queued(st.worker_id, st.rid):
                    # Merely queued at a live, busy worker: moving it elsewhere would only lose its place.
                    st.deadline = self._now + self.stage_timeout_s
                else:
                    self._uncharge(st)
                    self._restart(st, reason=f"{st.stage} stage timed out on {st.worker_id}")
        if self.members.draining:
            self._release_drained()

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
                "stats": dict(self.stats), "telemetry": self.telemetry.snapshot(), "queued": self.queues.counts(),
                "waiting": waiting_by_role(self.requests.values(), {w.role for w in self.members.routable()},
                                           self._now)}

    def unknown(self, client: bytes, request_ids: list[str]) -> list[str]:
        """Which of a client's request ids this coordinator does not hold (it restarted, or they ended)."""
        return [r for r in request_ids if (client, r) not in self.by_client]

    def _release_drained(self) -> None:
        """SHUTDOWN to each draining worker nothing depends on any more (coordinator/drain.py), once."""
        for worker_id in sorted(self.members.draining - self.members.shutdown_sent):
            if self.members.is_alive(worker_id) and not holds_work(self.requests.values(), worker_id):
                self.members.shutdown_sent.add(worker_id)
                log.info("worker %s drained: no work of this coordinator left on it; SHUTDOWN sent", worker_id)
                self._out.append(ToWorker(worker_id, MsgType.SHUTDOWN, {}))

    # -- stages ----------------------------------------------------------------------------------------
    def _restart(self, st: RequestState, first: bool = False, reason: str = "", ran: bool = True) -> None:
        """(Re)run a request from its first stage, keeping the tokens the client already has. `ran`:
        False when the attempt's stage never reached a worker (it is not counted against max_attempts)."""
        if not first:
            self.stats["reruns"] += 1
            st.undelivered += not ran
            self._cancel_on_worker(st)  # the stage may still be running on a live worker
            if st.attempt + 1 - st.undelivered >= self.max_attempts:
                unsent = f" ({st.undelivered} never reached a worker)" if st.undelivered else ""
                self._end(st, error=(ErrorCode.INTERNAL, f"gave up after {st.attempt + 1} attempts{unsent}: {reason}"))
                return
            log.warning("%s re-run (attempt %d): %s", st.client_rid, st.attempt + 2, reason)
            st.attempt += 1
        st.deadline = 0.0
        st.embeddings = st.kv = st.embeddings_from = st.kv_from = None
        st.parts = []
        st.next_stage = Stage.START
        self._advance(st)

    def _advance(self, st: RequestState) -> None:
        """Queue the request's next stage; `_dispatch_waiting` sends it once a worker can take it."""
        st.stage, st.deadline = Stage.QUEUED, self._now + self.stage_timeout_s  # a full stage timeout to find one
        self._wait(st, st.next_stage, since=self._now)

    def _wait(self, st: RequestState, stage: Stage, since: float) -> None:
        req = st.admitted.request
        self.queues.push(st.rid, stage, priority=req.priority, latency_class=req.latency_class, since=since)

    def _stage_done(self, st: RequestState, timing_key: str) -> None:
        st.timings[timing_key] += self._now - st.stage_started
        self._uncharge(st)

    # -- worker replies --------------------------------------------------------------------------------
    def _on_ready(self, worker_id: str, info: WorkerInfo) -> None:
        role = info.role
        if role not in ROLES:
            log.error("worker %s announced unknown role %r; ignored", worker_id, role)
            return
        why = pruning_mismatch(worker_id, role, info.visual_token_pruning, self.visual_token_pruning)
        if why is not None:  # its images would not fit the prompts admitted here: never give it work
            if self._refused.get(worker_id, -1.0) != info.visual_token_pruning:
                self._refused[worker_id] = info.visual_token_pruning
                log.error("%s", why)
            if self.members.is_alive(worker_id):  # restarted with another setting: its old self is gone
                self._worker_died(worker_id, "re-registered with another --visual-token-pruning")
            return
        self._refused.pop(worker_id, None)
        if self.members.is_alive(worker_id):  # a restarted process with the same id: its old work is lost
            self._worker_died(worker_id, "re-registered")
        for rid in self.members.join(worker_id, role, info.fields(), self._now):  # it was only stalled: stop its stale work
            self._out.append(ToWorker(worker_id, MsgType.CANCEL, {"request_id": rid}))
        log.info("worker %s joined as %s (data plane %s)", worker_id, role, info.data_address)

    def _worker_died(self, worker_id: str, why: str, undelivered: str | None = None) -> None:
        w = self.members.mark_dead(worker_id)
        if w is None:
            return
        log.warning("worker %s (%s) is gone: %s", worker_id, w.role, why)
        for st in list(self.requests.values()):
            # Its stage ran there, or data it still needs (embeddings, prefilled KV) was parked there.
            if st.needs(worker_id):
                if worker_id in st.stage_workers():
                    self.members.abandon(worker_id, st.rid)
                self._uncharge(st)
                ran = not (st.rid == undelivered and st.worker_id == worker_id)
                self._restart(st, reason=f"worker {worker_id} {why}", ran=ran)

    # -- results ----------------------------------------------------------------------------------------
    def _error(self, client: bytes, request_id: str | None, code: str, message: str, **extra: Any) -> None:
        self._out.append(ToClient(client, MsgType.ERROR, Error(request_id=request_id, code=code, message=message,
                                                               **extra).fields()))

    def _emit(self, st: RequestState, tokens: list[int], relay: bool = True) -> None:
        index = len(st.output_ids)
        if index == 0:
            self.first_tokens.record(self._now)
            st.first_token_at = self._now
        st.output_ids.extend(tokens)
        if st.admitted.request.stream and relay:
            # At index 0 the prompt's size too: a client that stops early (a stop string) still learns it.
            msg = Tokens(request_id=st.client_rid, index=index, token_ids=tokens,
                         prompt_tokens=len(st.admitted.prompt_ids) if index == 0 else None)
            self._out.append(ToClient(st.client, MsgType.TOKENS, msg.fields()))

    def _end(self, st: RequestState, *, finish_reason: str | None = None, error: tuple[str, str] | None = None,
             **error_extra: Any) -> None:
        self._uncharge(st)
        self.queues.discard(st.rid)
        self.requests.pop(st.rid, None)
        self.by_client.pop((st.client, st.client_rid), None)
        if error is not None:
            self.stats["failed"] += 1
            log.warning("%s failed: %s", st.client_rid, error[1])
            return self._error(st.client, st.client_rid, *error, **error_extra)
        self.stats["completed"] += 1
        self.telemetry.on_request(st, self._now)
        log.info("%s done: %d tokens (%s) in %.0f ms", st.client_rid, len(st.output_ids), finish_reason,
                 (self._now - st.arrived) * 1e3)
        body = result_body(st, finish_reason or "stop", self.detokenize(st.output_ids), self._now)
        self._out.append(ToClient(st.client, MsgType.RESULT, body))

    def _cancel_on_worker(self, st: RequestState, skip: str | None = None) -> None:
        """CANCEL the request wherever it runs or has data parked (but on `skip`, which already gave up on it)."""
        targets = st.stage_workers()
        if st.embeddings is not None or st.parts:
            # Embeddings parked on encoders for a prefill that will not come: let them free them now
            # rather than at the transfer's expiry.
            targets |= st.embedding_sources()
        for worker_id in sorted(targets - {skip}):
            if self.members.is_alive(worker_id):
                self._out.append(ToWorker(worker_id, MsgType.CANCEL, {"request_id": st.rid}))
