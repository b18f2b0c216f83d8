"""When one worker should change role, prefill <-> decode, as the load mix shifts. Pure: no sockets, no clock.

The coordinator (with `--role-switching`) asks `decide` on every tick, from what it already holds:
the routable prefill and decode workers as routing sees them (`WorkerView`: the prompt tokens charged
to each, the sequences each holds), the prompt tokens of the requests waiting at the coordinator for a
prefill, and the requests waiting for a decode. Two pressures, each per worker of its pool:

* prefill backlog: prompt tokens queued at or charged to the prefill pool, per prefill worker;
* decode load: sequences held by (or waiting for) the decode pool, per decode worker.

Prefill-heavy (backlog >= `prefill_heavy_tokens` while decode load <= `decode_light_seqs`): the decode
worker holding the fewest sequences becomes a prefill worker. Decode-heavy (decode load >=
`decode_heavy_seqs` while backlog <= `prefill_light_tokens`): the prefill worker with the least backlog
becomes a decode worker. It does not flap: the heavy and light thresholds leave a gap between the two
regimes, a regime must hold for `sustain_s` without a break before it counts, no switch starts while
one is under way, and none within `cooldown_s` of the last. It never takes the last worker of a pool
(a pool of one is never switched away), and it leaves unified and encode workers alone: a unified
worker serves only while the prefill/decode pipeline is incomplete (routing.pipeline_for), so
switching to or from it is the operator's call (`mserve switch-role`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mserve.coordinator.routing import WorkerView, alive

PREFILL_HEAVY, DECODE_HEAVY = "prefill-heavy", "decode-heavy"


@dataclass(frozen=True)
class RolePolicy:
    """The thresholds, one place: the regimes' edges, and how long they must hold.

    Set against the scale model (`cd bench && python -m lab.role_sweep`, bench/README.md "Role switching,
    in the scale model"): prefill_heavy_tokens 1024-4096 made no difference (a prefill-behind pool held 5-20 k
    tokens per worker); decode_heavy_seqs 8-24 moved prefill workers to decode where a second decode worker
    only split the batch, 48 never fired at 32 requests in flight; sustain 2 s flapped. decode_light_seqs was
    4: a decode pool at 4-8 sequences per worker while prompts queued kept the slow layout; 12 (< half of
    decode_heavy_seqs, so the workers left do not turn decode-heavy at once) gave 2.38 req/s for 2.08 there."""

    prefill_heavy_tokens: int = 2048  # prompt tokens per prefill worker: prefill is behind
    prefill_light_tokens: int = 256  # ... prefill keeps up
    decode_heavy_seqs: int = 32  # sequences per decode worker: decode batches are full (half of max_num_seqs 64)
    decode_light_seqs: int = 12  # ... decode has room to give a worker away (was 4; see above)
    sustain_s: float = 5.0  # a regime counts once it held this long without a break
    cooldown_s: float = 30.0  # no switch within this long of the last one started


@dataclass(frozen=True)
class RoleMemory:
    """What the policy remembers between calls: the regime seen, since when, and the last switch."""

    regime: str | None = None
    since: float = 0.0
    last_switch: float | None = None


@dataclass(frozen=True)
class Decision:
    worker_id: str
    role: str  # the role it switches to
    reason: str


@dataclass(frozen=True)
class Pressure:
    prefill_tokens_per_worker: float
    decode_seqs_per_worker: float


def held_seqs(w: WorkerView) -> int:
    """Sequences a decode worker holds: those the coordinator handed it, or those it reports, whichever is more."""
    return max(w.inflight, w.running + w.queue_len)


def pressure(prefill: Sequence[WorkerView], decode: Sequence[WorkerView], queued_prompt_tokens: int,
             queued_decodes: int) -> Pressure:
    backlog = sum(w.inflight_tokens for w in prefill) + queued_prompt_tokens
    seqs = sum(held_seqs(w) for w in decode) + queued_decodes
    return Pressure(backlog / max(len(prefill), 1), seqs / max(len(decode), 1))


def regime(p: Pressure, policy: RolePolicy) -> str | None:
    if p.prefill_tokens_per_worker >= policy.prefill_heavy_tokens and p.decode_seqs_per_worker <= policy.decode_light_seqs:
        return PREFILL_HEAVY
    if p.decode_seqs_per_worker >= policy.decode_heavy_seqs and p.prefill_tokens_per_worker <= policy.prefill_light_tokens:
        return DECODE_HEAVY
    return None


def decide(workers: Sequence[WorkerView], queued_prompt_tokens: int, queued_decodes: int, switching: int,
           memory: RoleMemory, now: float, policy: RolePolicy = RolePolicy()) -> tuple[Decision | None, RoleMemory]:
    """(the switch to start now or None, the memory to pass next time). `workers`: the routable ones;
    `switching`: how many switches are under way."""
    prefill, decode = alive(workers, "prefill"), alive(workers, "decode")
    p = pressure(prefill, decode, queued_prompt_tokens, queued_decodes)
    seen = regime(p, policy) if prefill and decode else None
    if seen != memory.regime:  # a new regime (or none): its clock starts now
        memory = RoleMemory(seen, now, memory.last_switch)
    if seen is None or switching or now - memory.since < policy.sustain_s:
        return None, memory
    if memory.last_switch is not None and now - memory.last_switch < policy.cooldown_s:
        return None, memory
    if seen == PREFILL_HEAVY:
        if len(decode) < 2:
            return None, memory
        w = min(decode, key=lambda w: (held_seqs(w), w.worker_id))
        why = (f"prefill-heavy for {now - memory.since:.1f}s: {p.prefill_tokens_per_worker:.0f} prompt tokens per "
               f"prefill worker, {p.decode_seqs_per_worker:.1f} sequences per decode worker")
        decision = Decision(w.worker_id, "prefill", why)
    else:
        if len(prefill) < 2:
            return None, memory
        w = min(prefill, key=lambda w: (w.inflight_tokens, w.worker_id))
        why = (f"decode-heavy for {now - memory.since:.1f}s: {p.decode_seqs_per_worker:.1f} sequences per decode "
               f"worker, {p.prefill_tokens_per_worker:.0f} prompt tokens per prefill worker")
        decision = Decision(w.worker_id, "decode", why)
    # The regime's clock restarts too: the next switch needs the regime to hold anew after the cooldown.
    return decision, RoleMemory(None, now, now)


def keeps_serving(roles_left: dict[str, int]) -> bool:
    """Whether the routable workers left (role -> count) still serve a text request: a unified worker,
    or a prefill and a decode worker. (Images also need encode; switching never touches encode.)"""
    return roles_left.get("unified", 0) > 0 or (roles_left.get("prefill", 0) > 0 and roles_left.get("decode", 0) > 0)
