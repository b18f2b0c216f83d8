"""A worker's links to its coordinator(s): one DEALER per coordinator shard (docs/scaling.md).

With one coordinator this is one socket. With sharded coordinators the worker keeps a socket to
every shard: the ones named by ``--coordinator`` (a comma-separated list) and the ones announced in
Redis (common/shards.py), which come and go. Every shard hears the worker's READY and
heartbeats; a stage message is answered on the link it came in on (each request's record on the
worker keeps it: `origin_of`), and a decode step's tokens are split into one STEP_TOKENS per shard.

When a shard announced in Redis leaves the registry (it died, or stopped), its link is closed and
returned, for the worker to cancel the requests it sent: nobody else would advance them.
A shard named on the command line is never dropped (ZeroMQ reconnects to it when it comes back).

Not thread-safe by itself: the worker's loop and its pulse thread share it under ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from mserve.common.protocol import MsgType
from mserve.common.protocol.to_coordinator import StepTokens
from mserve.common.protocol.typed import Message
from mserve.common.security import CurveKeys, HandshakeWatch
from mserve.common.shards import SHARD_TTL_S, ShardRegistry
from mserve.common.sockets import make_socket, recv, send

log = logging.getLogger("mserve.worker")


@dataclass
class Link:
    address: str
    sock: zmq.Socket
    shard_id: str | None = None  # as announced in Redis; None until seen there
    static: bool = False  # named on the command line: never dropped
    handshake: HandshakeWatch | None = None
    missing_since: float | None = None  # when the registry first no longer listed it


class CoordinatorLinks:
    def __init__(self, ctx: zmq.Context, worker_id: str, static: list[str], *, keys: CurveKeys | None = None,
                 registry: ShardRegistry | None = None, grace_s: float = SHARD_TTL_S,
                 origin_of: Callable[[str], str | None] = lambda rid: None) -> None:
        self.ctx, self.worker_id, self.keys, self.registry = ctx, worker_id, keys, registry
        self.origin_of = origin_of  # request id -> the address of the shard it came from, while it is here
        # A shard is dropped once absent from the registry this long, not at one read: a Redis that
        # restarted empty is re-announced into within half a second, and must not cost every request.
        self.grace_s = grace_s
        self.lock = threading.Lock()
        self.links: dict[str, Link] = {}
        self.released: set[str] = set()  # shards that sent SHUTDOWN while this worker drains
        self._poller = zmq.Poller()
        for address in static:
            self._open(address, None, static=True)

    @property
    def addresses(self) -> list[str]:
        return list(self.links)

    def _open(self, address: str, shard_id: str | None, static: bool = False) -> None:
        sock = make_socket(self.ctx, zmq.DEALER, connect=address, identity=self.worker_id.encode(),
                           curve=self.keys.client() if self.keys else None)
        # Under CURVE a coordinator that refuses this worker's key would only look unreachable: say why.
        self.links[address] = Link(address, sock, shard_id, static, HandshakeWatch(sock) if self.keys else None)
        self._poller.register(sock, zmq.POLLIN)

    def _close(self, link: Link) -> None:
        self._poller.unregister(link.sock)
        if link.handshake:
            link.handshake.close()
        link.sock.close(linger=0)
        del self.links[link.address]
        self.released.discard(link.address)

    # -- shards coming and going (the loop calls refresh, under the lock) ------------------------------
    def refresh(self, live: dict[str, dict[str, str]] | None = None) -> tuple[list[Link], list[Link]]:
        """Follow the registry: (links opened, links closed: their shards left). `live`: a read of it
        made elsewhere (a worker reads it on its Redis lane, common/redis_lane.py); None: read it here.
        Takes the lock itself, after the Redis read, so the pulse thread never waits on Redis."""
        if live is None:
            live = self.registry.live() if self.registry is not None else {}
        wanted = {info["worker"]: sid for sid, info in live.items()}
        opened: list[Link] = []
        closed: list[Link] = []
        with self.lock:
            for address, sid in wanted.items():
                if address not in self.links:
                    self._open(address, sid)
                    opened.append(self.links[address])
                    log.info("coordinator shard %s joined at %s: connected (%d link(s))", sid, address,
                             len(self.links))
                elif self.links[address].shard_id is None:
                    self.links[address].shard_id = sid
            now = time.monotonic()
            for link in [link for link in self.links.values() if not link.static]:
                if link.address in wanted:
                    link.missing_since = None
                    continue
                link.missing_since = link.missing_since or now
                if now - link.missing_since < self.grace_s:
                    continue
                log.warning("coordinator shard %s at %s left the registry: link closed", link.shard_id, link.address)
                self._close(link)
                closed.append(link)
        return opened, closed

    # -- receiving (under the lock) ------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> list[Link]:
        """The links with a message waiting, after waiting at most `timeout_ms` for one."""
        ready = dict(self._poller.poll(timeout_ms))
        return [link for link in self.links.values() if link.sock in ready]

    def recv(self, link: Link) -> tuple[int, Any]:
        """One message from `link` (raises zmq.Again when none)."""
        _, kind, payload = recv(link.sock, flags=zmq.NOBLOCK)
        return kind, payload

    def release(self, link: Link) -> bool:
        """SHUTDOWN from `link` while draining; True once every shard has released this worker."""
        self.released.add(link.address)
        return set(self.links) <= self.released

    # -- sending (under the lock) -----------------------------------------------------------------------------
    def send(self, msg: Message, kind: MsgType) -> bool:
        """Send without blocking where `msg` belongs: its request's shard, each shard its own tokens, or every
        shard (registration, heartbeats, goodbye). False when a send found its coordinator unreachable."""
        if isinstance(msg, StepTokens) and len(self.links) > 1:
            by_link: dict[str, list[Any]] = {}
            for item in msg.items:
                by_link.setdefault(self._address_of(item.request_id), []).append(item)
            return all([self.send_to(address, StepTokens(items=items), kind) for address, items in by_link.items()])
        rid = getattr(msg, "request_id", None)
        if isinstance(rid, str):
            return self.send_to(self._address_of(rid), msg, kind)
        return all([self.send_to(address, msg, kind) for address in list(self.links)])

    def _address_of(self, rid: str) -> str:
        address = self.origin_of(rid)
        if address is None and len(self.links) == 1:
            address = next(iter(self.links))
        return address or ""

    def send_to(self, address: str, msg: Message, kind: MsgType) -> bool:
        link = self.links.get(address)
        if link is None:  # its shard left; nobody waits for this any more
            log.info("%s for %s dropped: its coordinator shard is gone", kind.name, getattr(msg, "request_id", "-"))
            return True
        try:
            send(link.sock, kind, msg.to_body(), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("coordinator at %s unreachable: %s for %s dropped", address, kind.name,
                        getattr(msg, "request_id", "-"))
            return False

    def handshake_failures(self) -> list[str]:
        return [f"{link.address}: {why}" for link in self.links.values()
                if link.handshake is not None and (why := link.handshake.failure())]

    def close(self, bye: Message | None = None) -> None:
        for link in list(self.links.values()):
            if bye is not None:
                try:
                    send(link.sock, bye.KIND, bye.to_body(), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            if link.handshake:
                link.handshake.close()
            link.sock.close(linger=200)
        self.links.clear()
