"""Sharded coordinators: which shard owns a request, and the shard registry in Redis (docs/scaling.md).

A cluster may run K coordinator processes ("shards"). Each owns the requests sent to it and is the
only one that advances them, so no per-request state is shared. What the shards share lives in Redis
already (worker registry and load, embedding and prefix indexes); this module adds their own
registry, `mserve:coordinator:{shard_id}` (client address, worker address, started), a hash with a
3 s TTL that each shard rewrites every 0.5 s. Workers read it to connect to every shard; clients
read it (an address ``redis://...``) to learn where to send requests.

A client picks the shard of a request by rendezvous hashing of its request id over the live
shards: adding or removing a shard moves only the requests that hash to it, and every client
agrees without talking to the others.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mserve.common.redis_store import RedisStore

SHARD_TTL_S = 3.0  # a shard silent this long has left the registry
SHARD_REFRESH_S = 0.5  # how often a shard rewrites its entry


def is_redis_url(value: str) -> bool:
    return value.startswith(("redis://", "rediss://", "unix://"))


def split_addresses(value: str) -> list[str]:
    """``"tcp://a:1, tcp://b:2"`` -> the addresses in order, without blanks or repeats."""
    out: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    if not out:
        raise ValueError(f"no address in {value!r}")
    return out


def pick_shard(key: str, shards: Sequence[str]) -> str:
    """The shard that owns `key` (a request id): highest rendezvous weight, stable as shards come and go."""
    if not shards:
        raise ValueError("no coordinator shard to pick from")
    if len(shards) == 1:
        return shards[0]
    return max(shards, key=lambda s: hashlib.blake2b(f"{s}\x00{key}".encode(), digest_size=8).digest())


def advertised(bind: str, advertise: str | None, what: str) -> str:
    """The address others connect to: `advertise`, else `bind` when that is a connectable address."""
    if advertise:
        return advertise
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0]
    if host in ("*", "0.0.0.0", "[::]", "::"):
        raise ValueError(f"{what} binds {bind!r}, which is not an address others can connect to: "
                         f"give the address to announce (--advertise / --worker-advertise)")
    return bind


class ShardRegistry:
    """The coordinator shards in Redis; tolerant of outages like every RedisStore call (last good answer)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._live: dict[str, dict[str, str]] = {}

    def _key(self, shard_id: str = "") -> str:
        return self.store._k("coordinator", shard_id)

    def announce(self, shard_id: str, client_address: str, worker_address: str, started: float,
                 ttl_s: float = SHARD_TTL_S) -> bool:
        """Write (or refresh) this shard's entry; call every SHARD_REFRESH_S."""
        fields = {"client": client_address, "worker": worker_address, "started": repr(started)}
        return self.store._call(lambda: self.store._replace_hash(self._key(shard_id), fields, ttl_s), lambda: False)

    def withdraw(self, shard_id: str) -> bool:
        """A clean exit: leave the registry now instead of after the TTL."""
        return self.store._call(lambda: self.store._r.delete(self._key(shard_id)) >= 0, lambda: False)

    def live(self) -> dict[str, dict[str, str]]:
        """shard id -> {client, worker, started} of every shard announced within the TTL."""
        return self.store._call(self._read, lambda: dict(self._live))

    def _read(self) -> dict[str, dict[str, str]]:
        r, head = self.store._r, self._key()
        keys = sorted(r.scan_iter(match=head.replace("*", r"\*") + "*", count=500))
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        live = {key[len(head):]: dict(raw) for key, raw in zip(keys, pipe.execute())
                if raw and raw.get("client") and raw.get("worker")}
        self._live = live
        return live


def client_addresses_from_redis(url: str, *, wait_s: float = 0.0) -> list[str]:
    """The client addresses of the live shards registered in the Redis at `url` (sorted by shard id).

    Waits up to `wait_s` for at least one; raises ValueError naming the URL when there is none.
    """
    from mserve.common.redis_store import RedisStore

    store = RedisStore(url)
    try:
        registry = ShardRegistry(store)
        deadline = time.monotonic() + wait_s
        while True:
            live = registry.live()
            if live or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    finally:
        store.close()
    if not live:
        raise ValueError(f"no coordinator shard is registered in {url} (start coordinators with --shard-id and "
                         f"--redis {url}), or Redis is unreachable")
    return [live[s]["client"] for s in sorted(live)]


def resolve_client_addresses(address: str) -> list[str]:
    """A client's `address`: one coordinator, a comma-separated list of shards, or ``redis://...`` to read
    the live shards from their registry."""
    if is_redis_url(address):
        return client_addresses_from_redis(address, wait_s=5.0)
    return split_addresses(address)


def describe(shards: dict[str, Any]) -> str:
    return ", ".join(f"{sid} ({info.get('worker')})" for sid, info in sorted(shards.items())) or "none"
