"""The autoscaler's loop: observe, decide, apply, and say why.

Every `interval_s`: read the cluster (`signals.Reader`), ask the policy for one decision per pool,
apply the changes through the backend, and log them. Log lines, one per event:

    decode: 1 -> 2 (up): load 9 sequences = 9.00 per replica > 3 | started decode-as4242-1 (pid 4250, log ...)
    decode: hold at 2 (stabilizing): load 2 sequences = 1.00 per replica; with 1 it would be ...
    decode-as4242-1 drained and exited (code 0) 1.3s after SIGTERM

A pool's hold is logged when its rule changes (steady -> stabilizing -> cooldown ...), and a one-line
summary of every pool every `summary_every_s`; everything else is at DEBUG (`mserve -v autoscale`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mserve.autoscale.backends import BackendError
from mserve.autoscale.policy import Decision, PolicyConfig, PolicyState, commit, decide
from mserve.autoscale.signals import Signals, Snapshot

log = logging.getLogger("mserve.autoscale")


class Autoscaler:
    def __init__(self, config: PolicyConfig, backend: Any, reader: Any, *, interval_s: float = 5.0,
                 summary_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.backend, self.reader = config, backend, reader
        self.interval_s, self.summary_every_s, self.clock = interval_s, summary_every_s, clock
        self.signals = Signals(config.slo)
        self.state = PolicyState()
        self.history: list[tuple[float, Decision, str]] = []  # applied changes: (when, decision, what was done)
        self.last: dict[str, Decision] = {}
        self.last_snapshot: Snapshot | None = None
        self._last_rule: dict[str, str] = {}
        self._next_summary = 0.0
        self._blind_since: float | None = None

    def tick(self) -> dict[str, Decision]:
        now = self.clock()
        for event in self.backend.poll():
            log.info("%s", event)
        snap = self.reader.read(self.signals, now)
        self.last_snapshot = snap
        if snap.source == "none":
            if self._blind_since is None:
                self._blind_since = now
                log.warning("no observation (%s): holding every pool as it is", snap.note)
            return {}
        if self._blind_since is not None:
            log.info("observing again (from the %s) after %.0fs", snap.source, now - self._blind_since)
            self._blind_since = None
        if snap.note:
            log.debug("%s", snap.note)
        current = self.backend.replicas(snap)
        decisions = decide(self.config, snap.observation, current, self.state)
        for pool, d in decisions.items():
            if d.action == "hold":
                rule_changed = self._last_rule.get(pool) != d.rule
                (log.info if rule_changed else log.debug)("%s", d)
            else:
                self._apply(d, now)
            self._last_rule[pool] = d.rule
        self.last = decisions
        if now >= self._next_summary:
            self._next_summary = now + self.summary_every_s
            log.info("pools (%s): %s", snap.source, ", ".join(
                f"{p} {d.current}" + (f"->{d.desired}" if d.action != "hold" else "") + f" ({d.rule})"
                for p, d in decisions.items()))
        return decisions

    def _apply(self, d: Decision, now: float) -> None:
        try:
            done = self.backend.scale(d.pool, d.current, d.desired)
        except BackendError as exc:
            # Counted as a change for the cool-downs: a backend that cannot do it is not asked every tick.
            commit(self.state, d, now)
            log.error("%s | FAILED: %s (next try after the pool's cool-down)", d, exc)
            return
        commit(self.state, d, now)
        self.history.append((now, d, done))
        log.info("%s | %s", d, done)

    def run(self, stop: threading.Event, once: bool = False) -> None:
        log.info("autoscaler running: backend %s, every %gs; %s", self.backend.name, self.interval_s,
                 "; ".join(f"{p} {pp.min_replicas}..{pp.max_replicas}, grow above {pp.scale_up_at:g}, shrink below "
                           f"{pp.scale_down_at:g} per replica" for p, pp in self.config.pools.items()))
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # a bad tick must not end autoscaling: the next one decides afresh
                log.exception("autoscaler tick failed")
            if once:
                return
            stop.wait(self.interval_s)
