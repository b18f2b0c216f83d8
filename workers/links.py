"""A worker's links to its coordinator(s): one DEALER per coordinator shard (docs/scaling.md).

With one coordinator this is one socket. With sharded coordinators the worker keeps a socket to
every shard: the ones named by ``--coordinator`` (a comma-separated list) and the ones announced in
Redis (common/shards.py), which come and go. Every shard hears the worker's READY and
heartbeats; a stage message is answered on the link it came in on (the worker remembers each
request's shard), and a decode step's tokens are split into one STEP_TOKENS per shard.

When a shard announced in Redis leaves the registry (it died, or stopped), its link is closed and
the requests it sent here are returned, for the worker to cancel: nobody else would advance them.
A shard named on the command line is never dropped (ZeroMQ reconnects to it when it comes back).

Not thread-safe by itself: the worker's loop and its pulse thread share it under ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
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

MAX_ORIGINS = 100_000  # request -> shard entries kept (oldest dropped first); far above what a worker holds


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
                 registry: ShardRegistry | None = None, grace_s: float = SHARD_TTL_S) -> None:
        self.ctx, self.worker_id, self.keys, self.registry = ctx, worker_id, keys, registry
        # A shard is dropped once absent from the registry this long, not at one read: a Redis that
        # restarted empty is re-announced into within half a second, and must not cost every request.
        self.grace_s = grace_s
        self.lock = threading.Lock()
        self.links: dict[str, Link] = {}
        self.origin: OrderedDict[str, str] = OrderedDict()  # request id -> address of the shard it came from
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
    def refresh(self) -> tuple[list[Link], list[str]]:
        """Follow the registry: (links opened, requests of the shards that left). Takes the lock itself,
        after the Redis read, so the pulse thread never waits on Redis."""
        live = self.registry.live() if self.registry is not None else {}
        wanted = {info["worker"]: sid for sid, info in live.items()}
        opened: list[Link] = []
        orphaned: list[str] = []
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
                mine = [rid for rid, address in self.origin.items() if address == link.address]
                orphaned.extend(mine)  # their origin stays: a late reply is dropped, not sent to another shard
                log.warning("coordinator shard %s at %s left the registry: link closed, its %d request(s) here "
                            "cancelled", link.shard_id, link.address, len(mine))
                self._close(link)
        return opened, orphaned

    # -- receiving (under the lock) ------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> list[Link]:
        """The links with a message waiting, after waiting at most `timeout_ms` for one."""
        ready = dict(self._poller.poll(timeout_ms))
        return [link for link in self.links.values() if link.sock in ready]

    def recv(self, link: Link) -> tuple[int, Any]:
        """One message from `link` (raises zmq.Again when none); remembers which shard its request is from."""
        _, kind, payload = recv(link.sock, flags=zmq.NOBLOCK)
        rid = payload.get("request_id") if isinstance(payload, dict) else None
        if isinstance(rid, str) and kind != MsgType.CANCEL:  # a late CANCEL must not move a re-sent request
            self.origin[rid] = link.address
            self.origin.move_to_end(rid)
            if len(self.origin) > MAX_ORIGINS:
                self.origin.popitem(last=False)
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
        address = self.origin.get(rid)
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
