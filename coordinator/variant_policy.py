"""Model-version routing: which variant of a named group of models serves a new request. Pure code.

Opt-in. A group (`llava=llava-small,llava-large`) names variants of one model, smallest first. A
request that names the group, not a variant, is routed here once, at admission:

* `batch` requests stay on the largest variant that has live workers: they trade latency for quality.
* `interactive` requests follow the group's interactive variant, kept in a small record the
  coordinator owns (`GroupState`, one per group). It starts on the largest live variant that meets the
  interactive TTFT objective (the coordinator's `--ttft-slo-ms interactive=MS`), and moves to a smaller
  one only when the current variant's predicted TTFT breaks the objective (strictly above it). It moves
  back up only once a larger variant's prediction has stayed below `release` times the objective for
  `hold_s` (hysteresis, as SLO-adaptive pruning does in pruning_policy.py): the traffic that leaves the
  large variant lowers its prediction, and without the gap and the hold it would come straight back.
* A variant with no live worker is skipped, and the decision's reason says so; with no live variant
  at all the decision has no variant (the request waits, as one does for a missing pool).

The prediction per variant (`variant_load`) is the one SLO-adaptive pruning makes for the whole
cluster (pruning_policy.predicted_ttft_s), taken over the variant's own waiting requests and workers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from mserve.common.policy import LATENCY_CLASSES
from mserve.coordinator.adaptive_pruning import queued_work
from mserve.coordinator.pruning_policy import predicted_ttft_s


@dataclass(frozen=True)
class VariantGroup:
    """A model name clients may ask for, standing for several served models, smallest first."""

    name: str
    variants: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a variant group needs a name (GROUP=SMALL,LARGE)")
        if len(self.variants) < 2:
            raise ValueError(f"variant group {self.name!r} needs at least two variants, smallest first "
                             f"(e.g. {self.name}=SMALL,LARGE), got {list(self.variants)}")
        if any(not v for v in self.variants):
            raise ValueError(f"variant group {self.name!r} has an empty variant name: {list(self.variants)}")
        dupes = sorted({v for v in self.variants if self.variants.count(v) > 1})
        if dupes:
            raise ValueError(f"variant group {self.name!r} names {', '.join(dupes)} twice")
        if self.name in self.variants:
            raise ValueError(f"variant group {self.name!r} cannot be one of its own variants")


def parse_variant_groups(value: str | None, setting: str = "variant_groups") -> dict[str, VariantGroup]:
    """`llava=llava-small,llava-large;qwen=qwen-2b,qwen-7b` -> {group name: VariantGroup}; {} for
    None or ""; ValueError naming `setting` otherwise. Groups are separated by `;`, variants by `,`."""
    groups: dict[str, VariantGroup] = {}
    for item in filter(None, (s.strip() for s in (value or "").split(";"))):
        name, eq, rest = item.partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"{setting}: {item!r} is not GROUP=SMALL,LARGE (variants smallest first, "
                             f"groups separated by ';')")
        if name in groups:
            raise ValueError(f"{setting}: group {name!r} is defined twice")
        try:
            groups[name] = VariantGroup(name, tuple(v.strip() for v in rest.split(",")))
        except ValueError as exc:
            raise ValueError(f"{setting}: {exc}") from None
    shared = sorted({v for g in groups.values() for v in g.variants if v in groups})
    if shared:
        raise ValueError(f"{setting}: {', '.join(shared)} is both a group and a variant")
    return groups


@dataclass(frozen=True)
class VariantRule:
    """When interactive traffic moves between variants."""

    ttft_slo_s: float  # the interactive TTFT objective
    release: float = 0.7  # move back up once a larger variant predicts below release * ttft_slo_s ...
    hold_s: float = 2.0  # ... for this long

    def __post_init__(self) -> None:
        if not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        if not 0 < self.release <= 1:
            raise ValueError(f"release must be in (0, 1], got {self.release}")
        if self.hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {self.hold_s}")


def variant_rule(ttft_slo_ms: Mapping[str, float], release: float = 0.7, hold_s: float = 2.0) -> VariantRule:
    """The rule from the coordinator's per-class objectives (adaptive_pruning.parse_per_class of
    ttft_slo_ms); ValueError naming the setting when it gives interactive none."""
    if "interactive" not in ttft_slo_ms:
        raise ValueError("variant groups route interactive requests by their TTFT objective, but ttft_slo_ms "
                         "gives interactive none (e.g. --ttft-slo-ms interactive=2000)")
    return VariantRule(ttft_slo_s=ttft_slo_ms["interactive"] / 1000.0, release=release, hold_s=hold_s)


@dataclass(frozen=True)
class VariantLoad:
    """One variant's figures at decision time."""

    live_workers: int  # routable workers serving it
    predicted_ttft_s: float = 0.0  # how long a request admitted to it now would wait for its first token


def variant_load(requests: Iterable[Any], workers: Iterable[Any]) -> VariantLoad:
    """A variant's load from the coordinator's own records: `requests` its RequestStates, `workers` its
    routable WorkerViews. The prediction is pruning_policy's: images to encode over the encoders' measured
    seconds per image, prompt tokens to prefill over the prefill workers' measured tokens/s. A variant
    served by unified workers only prefills there, at their measured rate."""
    workers = [w for w in workers if w.alive]
    work = queued_work(requests, workers)
    if work.prefill_workers == 0:
        rates = [w.tokens_per_s for w in workers if w.role == "unified" and w.tokens_per_s > 0]
        unified = sum(1 for w in workers if w.role == "unified")
        work = replace(work, prefill_tokens_per_s=sum(rates) / len(rates) if rates else 0.0, prefill_workers=unified)
    return VariantLoad(live_workers=len(workers), predicted_ttft_s=predicted_ttft_s(work))


@dataclass(frozen=True)
class GroupState:
    """What the coordinator keeps per group between decisions (the decision returns the next one)."""

    interactive: str | None = None  # the variant interactive requests go to; None: not chosen yet
    calm_since: float | None = None  # since when a larger live variant has predicted below the release level


@dataclass(frozen=True)
class VariantDecision:
    variant: str | None  # None: no variant of the group has a live worker (the request waits)
    reason: str  # one line, for the log and the request's trace
    state: GroupState  # the group's state after this decision: the caller stores it


def _skipped(group: VariantGroup, live: list[str]) -> str:
    dead = [v for v in group.variants if v not in live]
    return f"; skipped {', '.join(dead)} (no live workers)" if dead else ""


def _fastest(candidates: list[str], loads: Mapping[str, VariantLoad]) -> str:
    """The lowest prediction; on a tie the larger variant (candidates are smallest first)."""
    return min(reversed(candidates), key=lambda v: loads[v].predicted_ttft_s)


def _settle(candidates: list[str], loads: Mapping[str, VariantLoad], rule: VariantRule) -> str:
    """The largest candidate that meets the objective, else the one predicting the soonest first token."""
    meeting = [v for v in candidates if loads[v].predicted_ttft_s <= rule.ttft_slo_s]
    return meeting[-1] if meeting else _fastest(candidates, loads)


def choose_variant(group: VariantGroup, latency_class: str, loads: Mapping[str, VariantLoad], rule: VariantRule,
                   state: GroupState, now: float) -> VariantDecision:
    """The variant a new request to `group` goes to, why, and the group's next state. `loads` by variant
    (a variant missing from it has no live workers); `now` on the clock of `state.calm_since`."""
    if latency_class not in LATENCY_CLASSES:
        raise ValueError(f"unknown latency class {latency_class!r} (classes: {', '.join(LATENCY_CLASSES)})")
    live = [v for v in group.variants if v in loads and loads[v].live_workers > 0]
    skipped = _skipped(group, live)
    if not live:
        return VariantDecision(None, f"{group.name}: no variant has live workers "
                                     f"({', '.join(group.variants)}); waiting", state)
    slo_ms = rule.ttft_slo_s * 1e3

    def ms(v: str) -> str:
        return f"{v} predicts {loads[v].predicted_ttft_s * 1e3:.0f} ms"

    if latency_class == "batch":
        return VariantDecision(live[-1], f"{group.name}: batch stays on the largest live variant {live[-1]}{skipped}",
                               state)
    current = state.interactive
    if current not in live:
        chosen = _settle(live, loads, rule)
        why = "first interactive request" if current is None else f"{current} has no live workers"
        return VariantDecision(chosen, f"{group.name}: {why}; interactive to {chosen} ({ms(chosen)}, "
                                       f"objective {slo_ms:.0f} ms){skipped}", GroupState(chosen, None))
    at = live.index(current)
    if loads[current].predicted_ttft_s > rule.ttft_slo_s:
        smaller = live[:at]
        meeting = [v for v in smaller if loads[v].predicted_ttft_s <= rule.ttft_slo_s]
        chosen = meeting[-1] if meeting else _fastest([*smaller, current], loads)
        if chosen == current:
            return VariantDecision(current, f"{group.name}: {ms(current)} > objective {slo_ms:.0f} ms but no smaller "
                                            f"live variant would be sooner; interactive stays{skipped}",
                                   GroupState(current, None))
        return VariantDecision(chosen, f"{group.name}: {ms(current)} > objective {slo_ms:.0f} ms; interactive down "
                                       f"to {chosen} ({loads[chosen].predicted_ttft_s * 1e3:.0f} ms){skipped}",
                               GroupState(chosen, None))
    release_s = rule.release * rule.ttft_slo_s
    calm = [v for v in live[at + 1:] if loads[v].predicted_ttft_s < release_s]
    if not calm:
        larger = "" if at == len(live) - 1 else f"; no larger live variant below {release_s * 1e3:.0f} ms"
        return VariantDecision(current, f"{group.name}: interactive stays on {current} ({ms(current)}){larger}"
                                        f"{skipped}", GroupState(current, None))
    since = state.calm_since if state.calm_since is not None else now
    if now - since >= rule.hold_s:
        up = calm[-1]
        return VariantDecision(up, f"{group.name}: {ms(up)} < {release_s * 1e3:.0f} ms for {now - since:.1f} s; "
                                   f"interactive up from {current} to {up}{skipped}", GroupState(up, None))
    return VariantDecision(current, f"{group.name}: interactive stays on {current}; {ms(calm[-1])} < "
                                    f"{release_s * 1e3:.0f} ms for {now - since:.1f} of {rule.hold_s:g} s{skipped}",
                           GroupState(current, since))
