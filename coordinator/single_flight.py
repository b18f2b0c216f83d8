"""Single-flight encodes: at most one encode in flight per image in the cluster. Pure code, no sockets.

The dispatcher (coordinator/dispatch.py) asks `may_encode` before it sends a request's ENCODE. Each of
its images nobody holds yet (no embedding holder, coordinator/dispatch.py `_holders`) is either free,
and the request leads it (a local claim, plus a short lease shared by every coordinator shard: `Leases`,
Redis SET NX PX), or already encoding for another request or shard, and then the request is parked
here instead of encoding it again. A parked request claims nothing: it never holds up a third one.
It wakes (back to the ENCODE queue, in its old place) when an image it waits for is encoded
(`encoded`), when the leader stops leading (`release`: its stage ended, failed or its encoder died),
or, for a lease another shard holds, on the next `poll`. Woken, it is dispatched afresh: the images
now held are read back from their holders (routed there: `prefer`), the rest claimed again, so the
first waiter dispatched takes over a failed leader's images, and nothing is encoded twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol

LEASE_S = 5.0  # a lease outlives its shard this long at most; its holder renews it every third of it
POLL_S = 0.25  # how often a request parked on another shard's lease checks again


class Leases(Protocol):
    """Claims every coordinator shard sees (Redis): `claim` is atomic, only the owner renews or releases."""

    def claim(self, image_hash: str, owner: str, ttl_s: float) -> bool: ...

    def renew(self, image_hashes: list[str], owner: str, ttl_s: float) -> None: ...

    def release(self, image_hashes: list[str], owner: str) -> None: ...


class LocalLeases:
    """One coordinator alone: its own claims are the cluster's."""

    def claim(self, image_hash: str, owner: str, ttl_s: float) -> bool:
        return True

    def renew(self, image_hashes: list[str], owner: str, ttl_s: float) -> None:
        pass

    def release(self, image_hashes: list[str], owner: str) -> None:
        pass


@dataclass
class Parked:
    """A request waiting for images another request (here, or on another shard) is encoding."""

    rid: str
    since: float  # when it started waiting for its ENCODE: it goes back to the queue in that place
    hashes: set[str]  # the images it waits for
    remote: bool = False  # one of them is leased by another shard: woken by `poll`


@dataclass
class SingleFlight:
    leases: Leases = field(default_factory=LocalLeases)
    owner: str = "coordinator"  # this shard's name in the leases
    lease_s: float = LEASE_S
    poll_s: float = POLL_S
    leader: dict[str, str] = field(default_factory=dict)  # image hash -> the request here encoding it
    claims: dict[str, set[str]] = field(default_factory=dict)  # request -> the images it leads
    parked: dict[str, Parked] = field(default_factory=dict)  # request -> what it waits for
    waited: dict[str, set[str]] = field(default_factory=dict)  # request -> images it has waited for
    next_poll: float = 0.0
    next_renew: float = 0.0

    def may_encode(self, rid: str, hashes: Iterable[str], holders: Mapping[str, set[str]],
                   since: float) -> bool:
        """True: send the request's ENCODE now (it leads every image nobody holds); False: it is parked."""
        misses = sorted({h for h in hashes if not holders.get(h)})
        busy = {h for h in misses if self.leader.get(h, rid) != rid}
        if busy:
            self._park(rid, since, busy, remote=False)
            return False
        claimed = []
        for h in misses:
            if self.leader.get(h) == rid or self.leases.claim(h, self.owner, self.lease_s):
                claimed.append(h)
                continue
            fresh = [c for c in claimed if self.leader.get(c) != rid]
            if fresh:  # all or nothing: a parked request holds up no other
                self.leases.release(fresh, self.owner)
            self._park(rid, since, {h}, remote=True)
            return False
        for h in claimed:
            self.leader[h] = rid
            self.claims.setdefault(rid, set()).add(h)
        return True

    def deduplicated(self, rid: str, holders: Mapping[str, set[str]]) -> int:
        """Images the request waited for and now finds held: encodes saved (counted once, at its ENCODE)."""
        saved = {h for h in self.waited.pop(rid, set()) if holders.get(h)}
        return len(saved)

    def prefer(self, rid: str, holders: Mapping[str, set[str]]) -> set[str]:
        """The holders of the images the request waited for: its ENCODE goes to one (a read, not a forward)."""
        return set().union(*(holders.get(h, set()) for h in self.waited.get(rid, ())))

    def encoded(self, hashes: Iterable[str]) -> list[Parked]:
        """These images' embeddings are held now: their flights end; the requests that waited wake."""
        done = [h for h in hashes if h in self.leader]
        for h in done:
            rid = self.leader.pop(h)
            self.claims.get(rid, set()).discard(h)
            if not self.claims.get(rid):
                self.claims.pop(rid, None)
        if done:
            self.leases.release(done, self.owner)
        return self._wake(set(hashes))

    def release(self, rid: str) -> list[Parked]:
        """The request leads nothing any more (its encode failed, re-runs or ended): who waited wakes."""
        self.parked.pop(rid, None)
        hashes = self.claims.pop(rid, set())
        for h in hashes:
            self.leader.pop(h, None)
        if hashes:
            self.leases.release(sorted(hashes), self.owner)
        return self._wake(hashes)

    def forget(self, rid: str) -> list[Parked]:
        """The request ended: it neither leads nor waits."""
        self.waited.pop(rid, None)
        return self.release(rid)

    def poll(self, now: float) -> list[Parked]:
        """Renew this shard's leases; wake the requests parked on another shard's, to look again."""
        if now >= self.next_renew and self.leader:
            self.next_renew = now + self.lease_s / 3
            self.leases.renew(sorted(self.leader), self.owner, self.lease_s)
        if now < self.next_poll:
            return []
        self.next_poll = now + self.poll_s
        woken = [p for p in self.parked.values() if p.remote]
        for p in woken:
            del self.parked[p.rid]
        return woken

    def _park(self, rid: str, since: float, hashes: set[str], remote: bool) -> None:
        self.parked[rid] = Parked(rid, since, hashes, remote)
        self.waited.setdefault(rid, set()).update(hashes)

    def _wake(self, hashes: set[str]) -> list[Parked]:
        woken = [p for p in self.parked.values() if p.hashes & hashes]
        for p in woken:
            del self.parked[p.rid]
        return woken
