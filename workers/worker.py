"""The worker process around one role: sockets, registration, heartbeats, and the loop that drives the role.

The loop is: take every queued control message, run one batch of the role's work, report.
Heartbeats and load reports come from their own thread (workers/liveness.py), so a long
engine step never makes a busy worker look dead. A role (workers/roles/) is a subclass that says which stage messages it accepts
and how it runs them; a message meant for another role is refused, never run. Tensors leave
through the transfer engine (the coordinator only ever sees their descriptors); Redis gets this
worker's registration, load and cache indexes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable, ClassVar

import torch
import zmq

from mserve.common import tracing
from mserve.common.cpu_placement import io_zmq_context
from mserve.common.images import ImageError
from mserve.common.perf import freeze_startup_heap, resident_mib
from mserve.common.protocol import ROLE_ACCEPTS, MsgType, ProtocolError, parse_message
from mserve.common.protocol.to_coordinator import Bye, Failed, Heartbeat, WorkerInfo, WorkerLoad
from mserve.common.protocol.to_worker import TO_WORKER, Cancel, SwitchRole
from mserve.common.protocol.typed import Message
from mserve.common.security import CurveKeys, check_curve_settings
from mserve.common.serde import WireError
from mserve.common.shards import is_redis_url, split_addresses
from mserve.common.transfer import TransferEngine, TransferError
from mserve.workers.block_pool import OutOfBlocks
from mserve.workers.draining import Drain
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.links import CoordinatorLinks, Link
from mserve.workers.liveness import Pulse
from mserve.workers.requests import WorkerRequest, WorkerRequests
from mserve.workers.settings import WorkerSettings
from mserve.workers.verdicts import require_verified
from mserve.workers.worker_redis import WorkerRedis

log = logging.getLogger("mserve.worker")

class Worker:
    """What every role shares. Subclasses set ROLE and implement `start()` and `work()`."""

    ROLE: ClassVar[str] = ""
    PARTS: ClassVar[str] = "all"  # the model weights this role keeps: "vision", "text" or "all"

    def __init__(self, settings: WorkerSettings) -> None:
        assert settings.role == self.ROLE, (settings.role, self.ROLE)
        torch.set_num_threads(settings.threads)
        self.s = settings
        self.worker_id = settings.resolved_id()
        self.role = settings.role
        self.accepts = {kind: TO_WORKER[kind] for kind in ROLE_ACCEPTS[self.role]}
        self.model_name = settings.model_name or settings.model
        keys = None  # read before the model loads: a bad key file fails at once
        if check_curve_settings("worker", curve_secret_key=settings.curve_secret_key,
                                curve_server_key=settings.curve_server_key,
                                curve_authorized_keys=settings.curve_authorized_keys):
            keys = CurveKeys.from_files(settings.curve_secret_key, server_key=settings.curve_server_key,
                                        authorized_keys=settings.curve_authorized_keys)
        # A family without tests here proves its tokens against HF before this worker can say READY
        # (workers/probe.py; the verdict is cached, so a restart pays nothing).
        require_verified(settings.model, settings.device, settings.dtype)
        self.engine = Engine(self.engine_config(settings))
        runner = self.engine.runner
        self.memory = WorkerLoad(  # what this role holds, for `rss_mib` to be read against
            weights_mib=round(runner.weight_bytes() / 2**20, 1),
            kv_pool_mib=round(runner.kv.bytes_per_block * runner.kv.num_blocks / 2**20, 1) if runner.kv else 0.0,
            # a hybrid model's linear-attention state, held per running sequence beside the pool
            state_kib_per_seq=round(runner.linear_state_bytes() / 2**10, 1))
        self.ctx = zmq.Context.instance()
        io_zmq_context(self.ctx)  # zmq's socket threads beside the other IO threads (common/cpu_placement.py)
        self.transfer = TransferEngine(self.worker_id, backend=settings.transfer, host=settings.host, ctx=self.ctx,
                                       device=settings.device, shm_pool_bytes=settings.transfer_pool_mb * 2**20,
                                       curve=keys)
        # Registration, load, shard registry and indexes; every call while serving on the Redis lane's thread,
        # so neither the loop nor the pulse waits on Redis (workers/worker_redis.py).
        # The engine's own prefix-caching flag: off for models it cannot reuse a prefix of (engine.py).
        self.redis = WorkerRedis(settings.model_copy(update={"enable_prefix_caching":
                                                             self.engine.config.enable_prefix_caching}),
                                 self.worker_id, self.model_name, self.engine.pool)
        self.store, self.lane = self.redis.store, self.redis.lane
        # One link per coordinator shard: those named by --coordinator, and those announced in Redis (the
        # --redis store, or the one --coordinator redis://... names: then only those).
        self.requests = WorkerRequests()  # every request this worker holds, one record each (workers/requests.py)
        static = [] if is_redis_url(settings.coordinator) else split_addresses(settings.coordinator)
        self.links = CoordinatorLinks(self.ctx, self.worker_id, static, keys=keys, registry=self.redis.registry,
                                      origin_of=self.requests.origin_of)
        self.sock_lock = self.links.lock  # the loop and the pulse thread share the sockets
        self.pulse = Pulse(settings.heartbeat_s, self._heartbeat)
        self.running = True
        self.drain = Drain(settings.drain_timeout_s)  # SIGTERM: finish what it has, then exit (workers/draining.py)
        # SWITCH_ROLE: drain the same way, then `serve` builds this worker again as that role (workers/switching.py)
        self.switch_to: str | None = None
        self._tokens_ewma = 0.0
        self._last_rate_t = time.monotonic()
        self._tokens_since = 0
        self._next_refusal_log = 0.0

    def engine_config(self, s: WorkerSettings) -> EngineConfig:
        num_blocks = s.num_blocks
        if s.gpu_memory_fraction is not None or s.mig_device:  # a share of a GPU: size the pool to fit it
            from mserve.workers.sizing import partition_worker

            num_blocks = partition_worker(s, self.PARTS)
        return EngineConfig(
            s.model, device=s.device, dtype=s.dtype, compile=s.compile, block_size=s.block_size, num_blocks=num_blocks,
            exact_attention=s.exact_attention(),
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            max_prefill_tokens=s.max_prefill_tokens, class_aging_s=s.class_aging_s,
            enable_prefix_caching=s.enable_prefix_caching, state_snapshots=s.state_snapshots, max_image_pixels=s.max_image_pixels,
            max_image_bytes=s.max_image_bytes, parts=self.PARTS, visual_token_pruning=s.visual_token_pruning)

    # -- what a role implements ------------------------------------------------------------------------
    def start(self, task: Message) -> None:
        """Take one stage message of this role's kind (ENCODE, PREFILL, DECODE or RUN)."""
        raise NotImplementedError

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def work(self) -> None:
        """One batch of work: called whenever `busy()`."""
        raise NotImplementedError

    def poll_ms(self) -> int:
        """How long the loop may wait for a coordinator message before its next turn."""
        return 0 if self.busy() else 20

    def cancel(self, rid: str) -> None:
        if self.end(rid) is not None:
            log.info("%s cancelled", rid)

    def end(self, rid: str, attempt: int | None = None) -> WorkerRequest | None:
        """The one way a request leaves this worker (reported, failed, cancelled): its record goes, and
        whatever the engine still holds of it. With `attempt`, only that attempt's (a newer one stays)."""
        rec = self.requests.end(rid, attempt)
        if rec is not None or attempt is None:
            self.engine.abort(rid)
        if rec is not None and rec.trace is not None:
            self._export_trace(rec)
        return rec

    def _export_trace(self, rec: WorkerRequest) -> None:
        """The stage's span on this worker, under the coordinator's, and the parts noted meanwhile."""
        attributes = {"mserve.worker_id": self.worker_id, "mserve.attempt": rec.attempt, **rec.attributes}
        if rec.seq is not None:
            attributes["mserve.prefix_cache_hit_tokens"] = rec.cached_tokens
        parent = tracing.record(f"{self.role} worker", rec.trace, rec.arrived_ns, attributes=attributes,
                                error=rec.error)
        for name, start_ns, end_ns, attrs in rec.spans:
            tracing.record(name, parent, start_ns, end_ns, attributes=attrs)

    def queued_ids(self) -> list[str]:
        """Requests this worker holds but has not started: a stage timeout does not re-run them."""
        return [seq.request_id for seq in list(self.engine.scheduler.waiting)]

    # -- lifecycle ---------------------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, role=self.role, data_address=self.transfer.address,
                          host_id=self.transfer.host_id, pid=os.getpid(), model=self.model_name,
                          block_size=self.s.block_size, num_blocks=self.engine.pool.num_blocks, load=self.load(),
                          data_key=self.transfer.key, visual_token_pruning=self.s.visual_token_pruning,
                          model_path=os.path.abspath(self.s.model))

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.begin_drain())
        info = self.info()
        self.redis.register({k: v for k, v in info.fields().items() if k != "load"}, info.load)
        self._follow_shards(self.redis.live)
        if not self.links.links:
            log.info("no coordinator shard is registered in Redis yet: this worker joins them as they announce")
        freeze_startup_heap()
        self.send(info)
        self.pulse.start()
        runner = self.engine.runner
        log.info("worker %s ready: role %s, %s weights in %s, %s attention, %.0f MiB resident, data plane %s (%s)",
                 self.worker_id, self.role, self.PARTS, str(runner.dtype).removeprefix("torch."),
                 "exact" if runner.exact_attention else "padded", resident_mib(), self.transfer.address,
                 self.s.transfer)
        try:
            while self.running:
                wait_ms = self.poll_ms()
                with self.sock_lock:
                    readable = self.links.poll(wait_ms)
                if readable:
                    self._drain(readable)
                if self.busy():
                    self.work()
                now = time.monotonic()
                self._follow_shards(self.redis.registry_due(now))
                self.redis.publish_prefixes(now)
                self._republish_after_redis_loss()
                if self.drain.active:
                    self._drain_check()
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def begin_drain(self) -> None:
        """SIGTERM: take no new work (the coordinator hears it from the load), finish, exit; twice: exit now.
        Runs as a signal handler: flags only (the loop logs), no locks. During a role switch's drain it
        cancels the switch: the drain goes on, and the worker exits at its end."""
        if self.switch_to is not None:
            self.switch_to = None
        elif not self.drain.begin(time.monotonic()):
            self.stop()

    def begin_switch(self, msg: SwitchRole) -> None:
        """SWITCH_ROLE: drain as on SIGTERM, then leave the loop to come back as its role (workers/switching.py)."""
        why = ("it is draining" if self.drain.active else f"it is a {self.role} worker"
               if msg.role == self.role or self.role == "encode" else None if msg.worker_id == self.worker_id
               else f"the message names worker {msg.worker_id!r}")
        if why is not None:
            log.warning("worker %s ignores a switch to %s: %s", self.worker_id, msg.role, why)
            return
        self.switch_to = msg.role
        self.drain.begin(time.monotonic())

    def _drain_check(self) -> None:
        if not self.drain.announced:
            self.drain.announced = True
            log.info("worker %s draining (%s): %d running, %d queued, %d transfer(s) unfetched; exits once the "
                     "coordinator releases it (at most %gs; SIGTERM again to stop now)", self.worker_id,
                     f"to switch role to {self.switch_to}" if self.switch_to else "SIGTERM",
                     len(self.engine.scheduler.running), len(self.queued_ids()), self.transfer.pending(),
                     self.drain.timeout_s)
        why = self.drain.exit_reason(busy=self.busy(), unfetched=self.transfer.pending(), now=time.monotonic())
        if why is not None:
            (log.info if why.startswith("drained") else log.warning)("worker %s exits: %s", self.worker_id, why)
            self.stop()

    def close(self) -> None:
        self.pulse.stop()
        self.links.close(bye=Bye(worker_id=self.worker_id, switching_to=self.switch_to))
        self.drop_indexes()
        self.redis.close(timeout_s=max(2.0, 4 * self.s.redis_timeout_s))
        self.transfer.close()
        log.info("worker %s stopped", self.worker_id)

    def load(self) -> WorkerLoad:
        queued = self.queued_ids()
        return dataclasses.replace(
            self.memory, queue_len=len(queued), running=len(self.engine.scheduler.running), queued=queued,
            free_blocks=self.engine.pool.num_free_blocks, total_blocks=self.engine.pool.num_blocks,
            tokens_per_s=round(self._tokens_ewma, 2), rss_mib=round(resident_mib(), 1), draining=self.drain.active,
            counters={**self.engine.stats(), **self.transfer.counters()},
            histograms={"step_seconds": self.engine.step_seconds.snapshot()},
            at=time.time())  # lets the coordinator drop a report older than one it already has

    def count_tokens(self, n: int) -> None:
        self._tokens_since += n

    def _heartbeat(self) -> None:
        """On the pulse thread: tell the coordinator (and Redis) this worker lives, and its load."""
        now = time.monotonic()
        rate = self._tokens_since / max(now - self._last_rate_t, 1e-6)
        self._tokens_ewma = 0.7 * self._tokens_ewma + 0.3 * rate
        self._tokens_since, self._last_rate_t = 0, now
        with self.sock_lock:
            # Measured under the lock: every message this worker sent before the heartbeat reflects
            # an older state than it, so the coordinator never sees "idle" after a busy worker's
            # tokens. The registration rides along: a coordinator that restarted (or declared this
            # worker dead) re-admits it from its next heartbeat.
            info = self.info()
            self._send_locked(Heartbeat.of(info))
            refused = self.links.handshake_failures()
        if refused and time.monotonic() >= self._next_refusal_log:
            self._next_refusal_log = time.monotonic() + 60.0
            log.error("a coordinator does not let this worker in: %s", "; ".join(refused))
        self.redis.beat(info.load)

    def _republish_after_redis_loss(self) -> None:
        """On the loop: Redis came back empty (restart, FLUSHALL), or after an outage that dropped index
        writes; index again what this worker holds."""
        if not self.redis.indexes_lost():
            return
        n = self.republish_indexes()
        log.warning("redis is back (empty, or after an outage that dropped index writes): %d index entries "
                    "republished", n)

    def republish_indexes(self) -> int:
        """Queue this worker's cache entries back into the Redis indexes; returns how many."""
        return self.redis.republish_prefixes()

    def drop_indexes(self) -> None:
        """On a clean exit: queue this worker's entries out of the Redis indexes (the TTL covers a crash)."""
        self.redis.drop_prefixes(self.engine.pool.cached_hashes())

    def send(self, msg: Message, kind: MsgType | None = None, to: str | None = None) -> None:
        """Non-blocking: with no coordinator connected the message is dropped (and logged) rather
        than wedging the loop; the coordinator re-runs whatever it does not hear back about. A
        request's message goes to the shard its record came from, or `to`, a link's address."""
        with self.sock_lock:
            self._send_locked(msg, kind, to)

    def _send_locked(self, msg: Message, kind: MsgType | None = None, to: str | None = None) -> None:
        kind = kind or msg.KIND
        self.drain.link_down = not (self.links.send_to(to, msg, kind) if to is not None else self.links.send(msg, kind))

    def _follow_shards(self, live: dict[str, dict[str, str]] | None) -> None:
        """On the loop, with each read of the shard registry (made on the Redis lane): connect to coordinator
        shards that joined (READY on the new link), drop the ones that left and cancel what they sent here."""
        if live is None:
            return
        opened, closed = self.links.refresh(live)
        if opened:
            with self.sock_lock:
                info = self.info()
                for link in opened:
                    self.links.send_to(link.address, info, MsgType.READY)
        for link in closed:
            orphaned = self.requests.from_origin(link.address)
            if orphaned:
                log.warning("coordinator shard %s left: its %d request(s) here cancelled", link.shard_id, len(orphaned))
            for rid in orphaned:
                self.cancel(rid)

    # -- messages ------------------------------------------------------------------------------------------
    def _drain(self, readable: list[Link]) -> None:
        for link in readable:
            self._drain_link(link)

    def _drain_link(self, link: Link) -> None:
        while True:
            payload: Any = None
            try:
                with self.sock_lock:
                    msg_type, payload = self.links.recv(link)
                msg = parse_message(msg_type, payload, self.accepts)
                kind = msg.KIND
            except zmq.Again:
                return
            except (WireError, ProtocolError) as exc:
                log.error("dropped a message from the coordinator (%s worker): %s", self.role, exc)
                self._refuse(payload, str(exc), link)
                continue
            if kind is MsgType.SHUTDOWN:
                if self.drain.active:  # nothing of this coordinator's left here: exit once all have said so
                    self.drain.released = self.links.release(link)
                else:
                    self.stop()
            elif isinstance(msg, Cancel):
                self.cancel(msg.request_id)
            elif isinstance(msg, SwitchRole):
                self.begin_switch(msg)
            else:
                if msg.STARTS_STAGE:  # a newer attempt's record replaces the older one's
                    self.requests.arrive(msg.request_id, msg.attempt, origin=link.address,
                                         trace=getattr(msg, "trace", None) if tracing.enabled() else None)
                self.start(msg)

    def _refuse(self, payload: Any, why: str, link: Link) -> None:
        """A stage message this worker cannot run (another role's, or malformed) still ends its
        attempt at once: FAILED, retryable, so the coordinator routes it elsewhere without a timeout."""
        if isinstance(payload, dict) and isinstance(payload.get("request_id"), str) \
                and type(payload.get("attempt")) is int:  # it never became a request here: no record to end
            self._send_failed(payload["request_id"], payload["attempt"], f"{self.role} worker refused it: {why}",
                              retryable=True, to=link.address)

    def failed(self, rid: str, attempt: int, message: str, retryable: bool) -> None:
        """The attempt failed here: the coordinator hears so (through its record's link), and it ends."""
        if (rec := self.requests.get(rid, attempt)) is not None:
            rec.error = message
        self._send_failed(rid, attempt, message, retryable)
        self.end(rid, attempt)

    def _send_failed(self, rid: str, attempt: int, message: str, retryable: bool, to: str | None = None) -> None:
        log.warning("%s failed (attempt %d, %s): %s", rid, attempt, "retryable" if retryable else "final", message)
        self.send(Failed(request_id=rid, attempt=attempt, message=message, retryable=retryable), to=to)

    def guarded(self, rid: str, attempt: int, action: Callable[[], None]) -> bool:
        """Run `action` for one request; any failure costs that request an attempt (or ends it, when
        the request itself is bad), never the worker its life. True when it went through."""
        try:
            action()
            return True
        except TransferError as exc:
            self.failed(rid, attempt, f"transfer failed: {exc}", retryable=True)
        except (ValueError, ImageError) as exc:
            self.failed(rid, attempt, str(exc), retryable=False)
        except OutOfBlocks as exc:  # the pool filled since routing: another worker may have room
            self.failed(rid, attempt, str(exc), retryable=True)
        except Exception as exc:  # a bug must cost this request an attempt, not the worker its life
            log.exception("%s: failed", rid)
            self.failed(rid, attempt, f"{exc.__class__.__name__}: {exc}", retryable=True)
        return False


def make_worker(settings: WorkerSettings) -> Worker:
    """The worker class of `settings.role`."""
    from mserve.workers.roles import ROLE_CLASSES

    return ROLE_CLASSES[settings.role](settings)
