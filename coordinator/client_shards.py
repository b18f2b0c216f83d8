"""Which coordinator shard a client request goes to, and when a shard is taken for dead.

Shared by the sync and async clients (coordinator/client.py, coordinator/async_client.py); pure
Python but for reading the shard registry from Redis.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mserve.coordinator.client_core import MServeError

logger = logging.getLogger("mserve.coordinator.client")  # the clients' logger

__all__ = ["SHARD_DOWN_S", "SHARD_LIST_REFRESH_S", "SHARD_PROBES_UNANSWERED", "ShardChooser"]


# A coordinator shard that leaves this many probes in a row unanswered is taken for dead: its request
# ends as Lost (and generate() sends it to another shard) instead of waiting out its timeout. Only
# with several shards: a lone coordinator that is slow to answer is still the only one there is.
SHARD_PROBES_UNANSWERED = 2
SHARD_DOWN_S = 30.0  # a shard taken for dead is skipped by new requests this long
SHARD_LIST_REFRESH_S = 10.0  # a client given redis://... re-reads the shard registry this often


class ShardChooser:
    """Which coordinator shard a request goes to: rendezvous hashing of its id over the shards not taken
    for dead (common/shards.py); with one address, always that one.

    ``address`` as a client was given it: one address, a comma list, or ``redis://...``, whose registry
    is read now (waiting up to 5 s for a shard) and again every SHARD_LIST_REFRESH_S when a request is
    sent, so shards that join or move (new pod IPs) are followed. A failed re-read keeps the list."""

    def __init__(self, address: str) -> None:
        from mserve.common.shards import is_redis_url, resolve_client_addresses

        self.addresses = resolve_client_addresses(address)
        self._registry = address if is_redis_url(address) else None
        self._next_refresh = time.monotonic() + SHARD_LIST_REFRESH_S
        self._down_until: dict[str, float] = {}

    @property
    def sharded(self) -> bool:
        return len(self.addresses) > 1 or self._registry is not None

    def up(self, now: float) -> list[str]:
        """The shards not taken for dead (all of them, if every one is)."""
        if self._registry is not None and now >= self._next_refresh:
            self._refresh(now)
        return [a for a in self.addresses if self._down_until.get(a, 0.0) <= now] or self.addresses

    def pick(self, request_id: str, now: float) -> str:
        from mserve.common.shards import pick_shard

        return pick_shard(request_id, self.up(now))

    def _refresh(self, now: float) -> None:
        from mserve.common.shards import client_addresses_from_redis

        self._next_refresh = now + SHARD_LIST_REFRESH_S
        try:
            addresses = client_addresses_from_redis(self._registry)
        except ValueError as exc:  # none registered, or Redis down: keep what we have
            logger.warning("coordinator shard list not refreshed: %s", exc)
            return
        if addresses != self.addresses:
            logger.info("coordinator shards now: %s", ", ".join(addresses))
            self.addresses = addresses

    def send_until(self, deadline: float, probe_after_s: float, now: float) -> float:
        """How long a GENERATE's send may wait for its shard (a send waits while the coordinator is
        unreachable): until the request's deadline, or with shards only as long as a silent shard is
        given; then the shard is taken for dead and the request tries another."""
        if not self.sharded:
            return deadline
        return min(deadline, now + (SHARD_PROBES_UNANSWERED + 1) * probe_after_s)

    def gives_up(self, address: str, unanswered: int, now: float) -> bool:
        """True once the shard at `address` left SHARD_PROBES_UNANSWERED probes in a row unanswered (with
        shards only): it is taken for dead, and the silent request ends as Lost (shard_gone_reply)."""
        if not (self.sharded and unanswered >= SHARD_PROBES_UNANSWERED):
            return False
        self.mark_down(address, now)
        return True

    def tries(self) -> range:
        """For generate(): the tries left after each one, one try per shard."""
        return range(len(self.addresses) - 1, -1, -1)

    def resend_or_raise(self, request_id: str, exc: MServeError, tries_left: int) -> None:
        """generate()'s request was lost with its shard: raise, unless another shard may take it."""
        if not (self.sharded and tries_left):
            raise exc
        logger.warning("%s: %s; sending it to another shard", request_id, exc.message)

    def mark_down(self, address: str, now: float) -> None:
        logger.warning("coordinator shard at %s does not answer: new requests skip it for %.0fs", address,
                       SHARD_DOWN_S)
        self._down_until[address] = now + SHARD_DOWN_S
