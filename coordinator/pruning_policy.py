"""SLO-adaptive visual-token pruning: which keep ratio a new request of each latency class gets. Pure code.

Opt-in. Each latency class has a TTFT objective and a ceiling on its keep ratio (common/pruning.py:
the share of each image's visual tokens kept). While the predicted TTFT of a class breaks its
objective the class is "pruning": its new requests are admitted at the ceiling, so each image costs
fewer prompt tokens to prefill. It stops only once the prediction has stayed below `release` times
the objective for `hold_s` (hysteresis: a class does not flap on and off around its objective, and
pruned requests draining the backlog do not switch it off the moment they lower the prediction).
Below saturation, where the prediction meets the objective, no request is pruned.

The prediction (`predicted_ttft_s`) is the work queued ahead of a new request on the two stages
before its first token, divided by the pools' measured rates: images to encode over the encoders,
prompt tokens to prefill over the prefill workers. The caller feeds it every tick (`observe`) and
reads `keep_ratio` at admission.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClassObjective:
    """One latency class's pruning rule."""

    ttft_s: float  # the TTFT objective (SLO) of the class
    max_keep_ratio: float  # the keep ratio its requests get while it breaks the objective, in (0, 1]
    release: float = 0.7  # pruning stops below release * ttft_s ...
    hold_s: float = 2.0  # ... held this long

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ValueError(f"ttft_s must be > 0, got {self.ttft_s}")
        if not 0 < self.max_keep_ratio <= 1:
            raise ValueError(f"max_keep_ratio must be in (0, 1], got {self.max_keep_ratio}")
        if not 0 < self.release <= 1:
            raise ValueError(f"release must be in (0, 1], got {self.release}")
        if self.hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {self.hold_s}")


@dataclass(frozen=True)
class QueuedWork:
    """What a new request would wait behind before its first token, and how fast the pools clear it."""

    images_to_encode: int = 0
    encode_s_per_image: float = 0.0  # one encoder's measured rate
    encoders: int = 1
    prompt_tokens_to_prefill: int = 0
    prefill_tokens_per_s: float = 0.0  # one prefill worker's measured rate (0: not measured yet)
    prefill_workers: int = 1


def predicted_ttft_s(work: QueuedWork) -> float:
    """Seconds until a request admitted now could see its first token: the encode queue, then the
    prefill queue, each over its pool (a pool with no measured rate yet predicts nothing)."""
    encode = work.images_to_encode * work.encode_s_per_image / max(1, work.encoders)
    prefill = (work.prompt_tokens_to_prefill / (work.prefill_tokens_per_s * max(1, work.prefill_workers))
               if work.prefill_tokens_per_s > 0 else 0.0)
    return encode + prefill


@dataclass
class _ClassState:
    pruning: bool = False
    calm_since: float | None = None  # when the prediction last went below the release level


@dataclass
class PruningGovernor:
    objectives: dict[str, ClassObjective]  # by latency class; a class not listed is never pruned
    _state: dict[str, _ClassState] = field(default_factory=dict)

    def observe(self, latency_class: str, predicted_s: float, now: float) -> None:
        """The class's predicted TTFT at `now`: start pruning past the objective, stop after a calm hold."""
        rule = self.objectives.get(latency_class)
        if rule is None:
            return
        st = self._state.setdefault(latency_class, _ClassState())
        if predicted_s > rule.ttft_s:
            st.pruning, st.calm_since = True, None
        elif not st.pruning:
            return
        elif predicted_s >= rule.release * rule.ttft_s:
            st.calm_since = None  # between release and objective: keep pruning, the hold starts over
        elif st.calm_since is None:
            st.calm_since = now
            st.pruning = rule.hold_s > 0
        elif now - st.calm_since >= rule.hold_s:
            st.pruning, st.calm_since = False, None

    def pruning(self, latency_class: str) -> bool:
        st = self._state.get(latency_class)
        return st is not None and st.pruning

    def keep_ratio(self, latency_class: str, configured: float | None = None) -> float | None:
        """The keep ratio a request of this class is admitted at now: the class's ceiling while it
        prunes (or the cluster's fixed `configured` ratio, if lower); else `configured` (None: all)."""
        if not self.pruning(latency_class):
            return configured
        ceiling = self.objectives[latency_class].max_keep_ratio
        return ceiling if configured is None else min(ceiling, configured)
