"""SLO-adaptive visual-token pruning at the coordinator: the keep ratio admission gives a new request.

The policy (when a class prunes, and to what) is coordinator/pruning_policy.py; this module feeds it
the coordinator's own load figures every tick and answers admission. The prediction counts every
request still waiting for its first token, whatever its class: images not yet encoded over the encode
pool's measured seconds per image, prompt tokens not yet prefilled over the prefill pool's measured
tokens per second (the rates the workers report in their heartbeats).

A request admitted at a keep ratio of its own has its placeholders counted at it, its image hashes
marked with it (common/pruning.py: pruned_hash, so its pruned embeddings never mix with unpruned ones
in any cache) and its ENCODE carries it to the encoder. Only encode workers prune per request: while
a unified worker is registered no request is pruned adaptively (its RUN could land there).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from mserve.common.policy import LATENCY_CLASSES
from mserve.coordinator.pruning_policy import ClassObjective, PruningGovernor, QueuedWork, predicted_ttft_s
from mserve.coordinator.records import RequestState, Stage
from mserve.coordinator.routing import DEFAULT_ENCODE_S_PER_IMAGE


def parse_per_class(value: Any, setting: str) -> dict[str, float]:
    """`interactive=0.5,batch=0.25` (or a mapping) -> {class: value}; ValueError naming `setting`."""
    if value is None or value == "" or value == {}:
        return {}
    items: Iterable[tuple[str, Any]]
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, str):
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        if any("=" not in p for p in pairs):
            raise ValueError(f"{setting} must be CLASS=VALUE pairs separated by commas "
                             f"(classes: {', '.join(LATENCY_CLASSES)}), got {value!r}")
        items = (tuple(p.split("=", 1)) for p in pairs)  # type: ignore[misc]
    else:
        raise ValueError(f"{setting} must be CLASS=VALUE pairs, got {value!r}")
    out: dict[str, float] = {}
    for cls, v in items:
        cls = str(cls).strip()
        if cls not in LATENCY_CLASSES:
            raise ValueError(f"{setting}: unknown latency class {cls!r} (classes: {', '.join(LATENCY_CLASSES)})")
        try:
            out[cls] = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{setting}: {cls}={v!r} is not a number") from None
    return out


def objectives(ceilings: Mapping[str, float], ttft_slo_ms: Mapping[str, float],
               hold_s: float = 2.0) -> dict[str, ClassObjective]:
    """One ClassObjective per class given a keep-ratio ceiling (adaptive_pruning); each needs its TTFT
    objective (ttft_slo_ms). ValueError naming the settings otherwise."""
    missing = [c for c in ceilings if c not in ttft_slo_ms]
    if missing:
        raise ValueError(f"adaptive_pruning names {', '.join(missing)} but ttft_slo_ms gives no TTFT objective "
                         f"for it (e.g. --ttft-slo-ms {missing[0]}=2000)")
    out = {}
    for cls, ceiling in ceilings.items():
        try:
            out[cls] = ClassObjective(ttft_s=ttft_slo_ms[cls] / 1000.0, max_keep_ratio=ceiling, hold_s=hold_s)
        except ValueError as exc:
            raise ValueError(f"adaptive_pruning / ttft_slo_ms for {cls}: {exc}") from None
    return out


def queued_work(requests: Iterable[RequestState], workers: Iterable[Any]) -> QueuedWork:
    """What a request admitted now waits behind (every request without a first token) and the pools'
    measured rates (`workers`: the routable WorkerViews)."""
    images = tokens = 0
    for st in requests:
        if st.output_ids:
            continue
        tokens += len(st.admitted.prompt_ids)
        encoding = st.stage == Stage.ENCODE or (st.stage == Stage.QUEUED and st.next_stage in (Stage.START,
                                                                                               Stage.ENCODE))
        if encoding and st.embeddings is None:
            images += len(st.admitted.images)
    workers = list(workers)
    encoders = [w for w in workers if w.role == "encode"]
    prefills = [w for w in workers if w.role == "prefill"]
    per_image = [w.encode_s_per_image or DEFAULT_ENCODE_S_PER_IMAGE for w in encoders]
    rates = [w.tokens_per_s for w in prefills if w.tokens_per_s > 0]
    return QueuedWork(images_to_encode=images,
                      encode_s_per_image=sum(per_image) / len(per_image) if per_image else DEFAULT_ENCODE_S_PER_IMAGE,
                      encoders=len(encoders), prompt_tokens_to_prefill=tokens,
                      prefill_tokens_per_s=sum(rates) / len(rates) if rates else 0.0, prefill_workers=len(prefills))


class AdaptivePruning:
    """The governor, fed on the coordinator's tick, asked at admission."""

    def __init__(self, objectives: dict[str, ClassObjective], configured: float | None = None) -> None:
        self.governor = PruningGovernor(objectives)
        self.configured = configured  # the cluster's fixed --visual-token-pruning (None: off)
        self.predicted_s = 0.0
        self.unified_workers = False

    def observe(self, requests: Iterable[RequestState], workers: Iterable[Any], now: float) -> None:
        workers = list(workers)
        self.unified_workers = any(w.role == "unified" for w in workers)
        self.predicted_s = predicted_ttft_s(queued_work(requests, workers))
        for cls in self.governor.objectives:
            self.governor.observe(cls, self.predicted_s, now)

    def keep_ratio(self, latency_class: str) -> float | None:
        """A request of this class's own keep ratio now; None: the cluster's (not pruned adaptively)."""
        if self.unified_workers:
            return None
        ratio = self.governor.keep_ratio(latency_class, self.configured)
        return None if ratio == self.configured else ratio

    def status(self) -> dict[str, Any]:
        return {"predicted_ttft_s": round(self.predicted_s, 4),
                "pruning": [c for c in self.governor.objectives if self.governor.pruning(c)]}
