"""How many replicas each pool should have, and why. Pure: no sockets, no Redis, no clock.

Each tick the runner hands `decide` an `Observation` (per pool: workers taking work, the work in
the pool, requests parked for want of a worker, KV use, stage latency; for the cluster: SLO
attainment over the requests finished since the last tick, whether images arrived) and the replicas
each pool has now (started or starting, draining ones not counted). `decide` answers one `Decision`
per pool, with a sentence saying why; `commit` records a change that was applied, which starts that
pool's cool-down. Per pool, the first rule that applies wins:

1. ``min`` / ``max``: outside its bounds, a pool goes back inside at once (no cool-down).
2. ``from-zero``: a pool at 0 replicas with requests parked for it (an image request and no encoder)
   gets one at once (no cool-down).
3. ``starting``: replicas asked for are not serving yet: hold (do not pile more on top of them),
   for at most `start_timeout_s`.
4. ``up``: load per replica above `scale_up_at`, KV use above `kv_up_at` (decode), its stage's p90
   above `stage_slo_s`, or the cluster missing its SLO with this pool the bottleneck (TTFT: the
   busier of encode / prefill; TPOT: decode). Grows to ceil(load / scale_up_at), at least +1 and
   at most +`max_step_up`, unless within `up_cooldown_s` of its last change or at max.
5. ``down``: with one replica fewer, load per replica would still be below `scale_down_at` (and
   KV use below `kv_down_at`), its SLO is met, and that has held for `down_stable_s`: shrink by one,
   unless within `down_cooldown_s` of its last change. Never below max(min, 1): zero is rule 6's.
6. ``to-zero``: a pool allowed 0 replicas with `idle_to_zero_s` set (encode), at 1 replica, empty,
   and no image seen for `idle_to_zero_s`: 0.

Hysteresis is the gap between `scale_up_at` and `scale_down_at` (the down test is made on the load
the pool would have after shrinking, so a shrink can never put it straight over the up threshold
when `scale_down_at` <= `scale_up_at`), plus the stability window and the cool-downs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from mserve.autoscale import POOLS

UNITS = {"encode": "stages", "prefill": "stages", "decode": "sequences"}


@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int = 1
    max_replicas: int = 8
    scale_up_at: float = 4.0  # load per replica above which the pool grows
    scale_down_at: float = 1.0  # shrink when load / (replicas - 1) is below this
    kv_up_at: float | None = None  # fraction of KV blocks in use (decode)
    kv_down_at: float | None = None
    stage_slo_s: float | None = None  # p90 of this pool's stage time (encode_s, prefill_s, TPOT for decode)
    max_step_up: int = 2
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    down_stable_s: float = 60.0
    start_timeout_s: float = 300.0
    idle_to_zero_s: float | None = None  # with min_replicas 0: scale to zero after this long without images

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min <= max and max >= 1, got min {self.min_replicas} max {self.max_replicas}")
        if not 0 <= self.scale_down_at < self.scale_up_at:
            raise ValueError(f"hysteresis needs 0 <= scale_down_at < scale_up_at, got {self.scale_down_at} "
                             f"and {self.scale_up_at}")
        if (self.kv_up_at is None) != (self.kv_down_at is None) or (
                self.kv_up_at is not None and not 0 <= self.kv_down_at < self.kv_up_at <= 1):  # type: ignore[operator]
            raise ValueError(f"KV thresholds need 0 <= kv_down_at < kv_up_at <= 1 (both or neither), got "
                             f"{self.kv_down_at} and {self.kv_up_at}")
        if self.max_step_up < 1:
            raise ValueError("max_step_up must be >= 1")
        if self.idle_to_zero_s is not None and self.min_replicas != 0:
            raise ValueError("idle_to_zero_s needs min_replicas 0")


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None  # None: TTFT is not judged
    tpot_s: float | None = None
    target: float = 0.9  # fraction of finished requests that must meet each
    min_requests: int = 5  # fewer requests finished since the last tick: not judged


@dataclass(frozen=True)
class PolicyConfig:
    pools: Mapping[str, PoolPolicy]
    slo: SLO = SLO()


def default_config(**overrides: PoolPolicy) -> PolicyConfig:
    """Encode and prefill: grow above 4 stages per replica, shrink below 1. Decode: grow above 48
    sequences or 85 % KV use per replica, shrink below 16 and 50 %."""
    pools = {"encode": PoolPolicy(), "prefill": PoolPolicy(),
             "decode": PoolPolicy(scale_up_at=48, scale_down_at=16, kv_up_at=0.85, kv_down_at=0.5)}
    pools.update(overrides)
    return PolicyConfig(pools=pools)


@dataclass(frozen=True)
class PoolObservation:
    ready: int  # live workers taking new work (draining ones excluded)
    draining: int = 0
    load: float = 0.0  # encode / prefill: stages queued or running; decode: sequences
    waiting: int = 0  # requests parked because no worker of this pool can take them
    oldest_wait_s: float = 0.0
    kv_used: float | None = None  # fraction of the ready workers' KV blocks in use
    stage_p90_s: float | None = None  # over the requests finished since the last tick


@dataclass(frozen=True)
class Observation:
    now: float
    pools: Mapping[str, PoolObservation]
    ttft_attainment: float | None = None  # fraction of requests finished since the last tick within the SLO
    tpot_attainment: float | None = None
    finished: int = 0  # requests finished since the last tick
    images_seen: bool = False  # an image request arrived or finished since the last tick


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    rule: str  # which rule decided: min, max, from-zero, starting, up, down, to-zero, cooldown, at-max, steady, ...
    reason: str

    @property
    def action(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"

    def __str__(self) -> str:
        if self.action == "hold":
            return f"{self.pool}: hold at {self.current} ({self.rule}): {self.reason}"
        return f"{self.pool}: {self.current} -> {self.desired} ({self.rule}): {self.reason}"


@dataclass
class PoolState:
    last_change_at: float | None = None
    low_since: float | None = None  # since when the down test has held
    short_since: float | None = None  # since when fewer replicas serve than were asked for


@dataclass
class PolicyState:
    pools: dict[str, PoolState] = field(default_factory=lambda: {p: PoolState() for p in POOLS})
    last_image_at: float | None = None


def commit(state: PolicyState, decision: Decision, now: float) -> None:
    """Record that `decision` was applied: its pool's cool-down starts now."""
    if decision.action != "hold":
        ps = state.pools.setdefault(decision.pool, PoolState())
        ps.last_change_at, ps.low_since, ps.short_since = now, None, None


def decide(config: PolicyConfig, obs: Observation, current: Mapping[str, int],
           state: PolicyState) -> dict[str, Decision]:
    """One decision per pool in `config.pools` (updates the stability timers in `state`)."""
    enc = obs.pools.get("encode")
    if state.last_image_at is None or obs.images_seen or (enc is not None and (enc.load > 0 or enc.waiting > 0)):
        state.last_image_at = obs.now
    bottleneck = _ttft_bottleneck(config, obs, current)
    out = {}
    for pool, pp in config.pools.items():
        o = obs.pools.get(pool) or PoolObservation(ready=0)
        ps = state.pools.setdefault(pool, PoolState())
        n = int(current.get(pool, o.ready))
        busy = _per_replica(o, n) >= pp.scale_down_at and (o.load + o.waiting) > 0
        out[pool] = _decide_pool(pool, pp, o, n, ps, state, obs, _slo_miss(config.slo, obs, pool, bottleneck, busy))
    return out


# --------------------------------------------------------------------------- internals


def _per_replica(o: PoolObservation, n: int) -> float:
    return (o.load + o.waiting) / max(n, 1)


def _ttft_bottleneck(config: PolicyConfig, obs: Observation, current: Mapping[str, int]) -> str | None:
    """The pool a TTFT miss is blamed on: the busier (relative to its up threshold) of encode and prefill,
    if it is busy at all (above its down threshold)."""
    best, best_pressure = None, 0.0
    for pool in ("encode", "prefill"):
        pp, o = config.pools.get(pool), obs.pools.get(pool)
        if pp is None or o is None:
            continue
        per = _per_replica(o, int(current.get(pool, o.ready)))
        if per >= pp.scale_down_at and per > 0 and per / pp.scale_up_at > best_pressure:
            best, best_pressure = pool, per / pp.scale_up_at
    return best


def _slo_miss(slo: SLO, obs: Observation, pool: str, ttft_bottleneck: str | None, busy: bool) -> str | None:
    """Why this pool is missing the SLO, or None. Only a busy pool is blamed: more idle replicas would
    not help."""
    if obs.finished < slo.min_requests or not busy:
        return None
    if pool == "decode" and slo.tpot_s is not None and obs.tpot_attainment is not None \
            and obs.tpot_attainment < slo.target:
        return (f"TPOT <= {slo.tpot_s:g}s met by {obs.tpot_attainment:.0%} of {obs.finished} requests "
                f"(< {slo.target:.0%})")
    if pool == ttft_bottleneck and slo.ttft_s is not None and obs.ttft_attainment is not None \
            and obs.ttft_attainment < slo.target:
        return (f"TTFT <= {slo.ttft_s:g}s met by {obs.ttft_attainment:.0%} of {obs.finished} requests "
                f"(< {slo.target:.0%}), {pool} the busier stage")
    return None


def _describe_load(pool: str, o: PoolObservation, n: int) -> str:
    s = f"load {o.load:g} {UNITS.get(pool, 'units')}"
    if o.waiting:
        s += f" + {o.waiting} parked"
    s += f" = {_per_replica(o, n):.2f} per replica"
    if o.kv_used is not None:
        s += f", KV {o.kv_used:.0%} used"
    if o.stage_p90_s is not None:
        s += f", stage p90 {o.stage_p90_s:.3g}s"
    return s


def _decide_pool(pool: str, pp: PoolPolicy, o: PoolObservation, n: int, ps: PoolState, state: PolicyState,
                 obs: Observation, slo_miss: str | None) -> Decision:
    now = obs.now

    def d(desired: int, rule: str, reason: str) -> Decision:
        return Decision(pool, n, desired, rule, reason)

    if n < pp.min_replicas:
        return d(pp.min_replicas, "min", f"{n} replicas is below the minimum {pp.min_replicas}")
    if n > pp.max_replicas:
        return d(pp.max_replicas, "max", f"{n} replicas is above the maximum {pp.max_replicas}")
    if n == 0:
        ps.low_since = None
        if o.waiting > 0 or o.load > 0:
            return d(1, "from-zero", f"{o.waiting} request(s) parked with no {pool} worker to take them "
                                     f"(oldest {o.oldest_wait_s:.1f}s): starting one")
        return d(0, "zero", f"no {pool} work: stays at zero")
    # Replicas asked for but not serving yet: more on top would overshoot.
    if o.ready < n:
        ps.short_since = ps.short_since if ps.short_since is not None else now
        if now - ps.short_since < pp.start_timeout_s:
            ps.low_since = None
            return d(n, "starting", f"{n - o.ready} of {n} replica(s) not serving yet "
                                    f"({now - ps.short_since:.0f}s); waiting for them before deciding")
    else:
        ps.short_since = None
    since_change = math.inf if ps.last_change_at is None else now - ps.last_change_at
    load = _describe_load(pool, o, n)

    # -- up
    per = _per_replica(o, n)
    why_up = []
    if per > pp.scale_up_at:
        parked = f" + {o.waiting} parked" if o.waiting else ""
        why_up.append(f"load {o.load:g} {UNITS.get(pool, 'units')}{parked} = {per:.2f} per replica "
                      f"> {pp.scale_up_at:g}")
    if pp.kv_up_at is not None and o.kv_used is not None and o.kv_used > pp.kv_up_at:
        why_up.append(f"KV {o.kv_used:.0%} used > {pp.kv_up_at:.0%}")
    if pp.stage_slo_s is not None and o.stage_p90_s is not None and o.stage_p90_s > pp.stage_slo_s:
        why_up.append(f"stage p90 {o.stage_p90_s:.3g}s > {pp.stage_slo_s:g}s")
    if slo_miss:
        why_up.append(slo_miss)
    if why_up:
        ps.low_since = None
        reason = "; ".join(why_up)
        if n >= pp.max_replicas:
            return d(n, "at-max", f"at the maximum {pp.max_replicas} although {reason}")
        if since_change < pp.up_cooldown_s:
            return d(n, "cooldown", f"would grow ({reason}) but changed {since_change:.0f}s ago "
                                    f"(up cool-down {pp.up_cooldown_s:g}s)")
        want = math.ceil((o.load + o.waiting) / pp.scale_up_at)
        desired = min(pp.max_replicas, n + pp.max_step_up, max(n + 1, want))
        return d(desired, "up", reason)

    # -- to zero (encode): nothing in it, no image for the idle window
    floor = max(pp.min_replicas, 1)
    idle_for = now - (state.last_image_at if state.last_image_at is not None else now)
    if pp.idle_to_zero_s is not None and n == 1 and o.load == 0 and o.waiting == 0:
        if idle_for >= pp.idle_to_zero_s:
            if since_change < pp.down_cooldown_s:
                return d(n, "cooldown", f"idle for {idle_for:.0f}s but changed {since_change:.0f}s ago "
                                        f"(down cool-down {pp.down_cooldown_s:g}s)")
            return d(0, "to-zero", f"no image request for {idle_for:.0f}s (>= {pp.idle_to_zero_s:g}s)")
        return d(n, "steady", f"empty; scales to zero after {pp.idle_to_zero_s:g}s without images "
                              f"(last {idle_for:.0f}s ago)")

    # -- down
    if n > floor:
        after = (o.load + o.waiting) / (n - 1)
        kv_after = o.kv_used * n / (n - 1) if o.kv_used is not None else None
        low = after < pp.scale_down_at and (pp.kv_down_at is None or kv_after is None or kv_after < pp.kv_down_at)
        if low:
            ps.low_since = ps.low_since if ps.low_since is not None else now
            low_for = now - ps.low_since
            shrink = (f"{load}; with {n - 1} it would be {after:.2f} per replica (< {pp.scale_down_at:g})"
                      + (f", KV {kv_after:.0%} (< {pp.kv_down_at:.0%})"
                         if kv_after is not None and pp.kv_down_at is not None else ""))
            if low_for < pp.down_stable_s:
                return d(n, "stabilizing", f"{shrink}, for {low_for:.0f}s of the {pp.down_stable_s:g}s needed")
            if since_change < pp.down_cooldown_s:
                return d(n, "cooldown", f"would shrink ({shrink}) but changed {since_change:.0f}s ago "
                                        f"(down cool-down {pp.down_cooldown_s:g}s)")
            return d(n - 1, "down", f"{shrink}, for {low_for:.0f}s")
    ps.low_since = None
    band = f"grow above {pp.scale_up_at:g} per replica"
    if n > floor:
        band += f", shrink below {pp.scale_down_at:g} with one fewer"
    else:
        band += f", at the floor {floor}"
    return d(n, "steady", f"{load} ({band})")
