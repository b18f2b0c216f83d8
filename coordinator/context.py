"""What one model's request machine is made of, in one object: the state a step reads and changes.

The request machine (coordinator/requests.py) builds one Context and hands it to each of its parts
(the Dispatcher, the Lifecycle, the StageReplies, the RoleSwitcher) instead of the same seven shared
objects one by one. Pure: no sockets, no Redis connection, no clock (`now` is the step's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from mserve.coordinator.membership import Membership
from mserve.coordinator.records import Lookups, NoLookups, Outbox, RequestTable
from mserve.coordinator.settings import MachineSettings
from mserve.coordinator.shedding import FirstTokenRate
from mserve.coordinator.single_flight import SingleFlight
from mserve.coordinator.stage_queues import StageQueues
from mserve.coordinator.telemetry import Telemetry

# The machine's counters, as status()["stats"] shows them: declared here once, changed only by `count`.
COUNTERS = ("admitted", "rejected", "completed", "failed", "reruns", "shed", "spread_encodes", "token_items",
            "encode_deduplicated", "encodes_skipped_by_prefix", "pruned_adaptive", "local_prefills",
            "media_bytes_inline")


class Counters:
    """The one owner of the machine's counters: a name not in COUNTERS is a KeyError, not a new key."""

    def __init__(self) -> None:
        self._n = dict.fromkeys(COUNTERS, 0)

    def count(self, name: str, n: int = 1) -> None:
        if name not in self._n:
            raise KeyError(f"{name!r} is not a coordinator counter (context.COUNTERS)")
        self._n[name] += int(n)

    def __getitem__(self, name: str) -> int:
        return self._n[name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._n)


@dataclass
class Context:
    settings: MachineSettings
    rng: random.Random
    detokenize: Callable[[list[int]], str]
    lookups: Lookups = field(default_factory=NoLookups)
    flights: SingleFlight | None = None  # None: every ENCODE goes out at once, even for an image encoding elsewhere
    requests: RequestTable = field(default_factory=RequestTable)
    members: Membership = field(default_factory=Membership)
    queues: StageQueues = field(default_factory=StageQueues)
    outbox: Outbox = field(default_factory=Outbox)  # what the step answers besides the stages it sends
    counters: Counters = field(default_factory=Counters)
    telemetry: Telemetry = field(default_factory=Telemetry)
    first_tokens: FirstTokenRate = field(default_factory=FirstTokenRate)

    @property
    def now(self) -> float:
        """The clock of the step being taken."""
        return self.outbox.now
