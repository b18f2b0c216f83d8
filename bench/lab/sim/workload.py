"""Requests for the simulator: the shapes of bench/traces.py without building any image bytes.

`sim_trace` draws from the same seeded random streams, in the same order, as `make_trace` does
for the `text`, `image` and `mixed` traces, so arrival times, image sizes, priorities and latency
classes are the ones a real `mserve bench serve` run with the same flags sends (tested in
tests/bench/test_simulate.py). Prompt lengths come from the cost file (the checkpoint's template
and tokenizer, measured by the calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mserve.bench.traces import PRIORITY_LEVELS, arrival_times


@dataclass
class SimRequest:
    rid: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    priority: int = 0
    latency_class: str = "interactive"
    visual_tokens: int = 0  # image placeholder tokens inside prompt_tokens

    @property
    def has_images(self) -> bool:
        return bool(self.image_sizes)


def _resolutions(resolutions: Sequence[tuple[tuple[int, int], float]] | None):
    from mserve.bench.images import IMAGE_RESOLUTIONS

    sizes, weights = zip(*(resolutions or IMAGE_RESOLUTIONS))
    probs = np.asarray(weights, dtype=float) / float(np.sum(weights))
    return sizes, probs


def sim_trace(name: str, num_requests: int, seed: int, *, text_tokens: int, visual_tokens: int,
              rate: float = math.inf, burstiness: float = 1.0, image_share: float = 0.5, max_tokens: int = 64,
              interactive_share: float = 0.5,
              resolutions: Sequence[tuple[tuple[int, int], float]] | None = None) -> list[SimRequest]:
    """The `text`, `image` or `mixed` trace of `make_trace(name, num_requests, seed, ...)` as SimRequests."""
    if name not in ("text", "image", "mixed"):
        raise ValueError(f"the simulator draws the text, image and mixed traces, not {name!r}")
    ss = np.random.SeedSequence([seed, *name.encode()])
    r_arrival, r_class, _r_text, _r_img, r_shape = (np.random.default_rng(s) for s in ss.spawn(5))
    sizes, probs = _resolutions(resolutions)
    arrivals = arrival_times(num_requests, rate, burstiness, r_arrival)
    levels, pw = zip(*PRIORITY_LEVELS)
    # Generator.choice(a, p=p) is searchsorted(cdf, random(), "right") and every call below consumes
    # doubles of its own stream in order, so drawing the doubles in bulk gives make_trace's values
    # (checked against make_trace in the tests) at a fraction of the cost.
    size_cdf, prio_cdf = np.cumsum(probs), np.cumsum(np.asarray(pw, dtype=float) / sum(pw))
    size_cdf /= size_cdf[-1]
    prio_cdf /= prio_cdf[-1]
    u_class = r_class.random(2 * num_requests)
    u_shape = r_shape.random(2 * num_requests if name == "mixed" else num_requests if name == "image" else 0)
    prios = np.searchsorted(prio_cdf, u_class[0::2], side="right")
    k = 0
    out = []
    for i in range(num_requests):
        count = 0 if name == "text" else 1
        if name == "mixed":
            count = 1 if u_shape[k] < image_share else 0
            k += 1
        picked = []
        if count:
            picked = [tuple(sizes[int(np.searchsorted(size_cdf, u_shape[k], side="right"))])]
            k += 1
        lat = "interactive" if u_class[2 * i + 1] < interactive_share else "batch"
        out.append(SimRequest(rid=i, arrival_s=arrivals[i], prompt_tokens=text_tokens + visual_tokens * count,
                              max_tokens=max_tokens, image_sizes=picked, priority=int(levels[prios[i]]),
                              latency_class=lat, visual_tokens=visual_tokens * count))
    return out


def from_costs(costs, name: str, num_requests: int, seed: int, *, prompt_words: int = 64,
               **kw) -> list[SimRequest]:
    """`sim_trace` with the prompt sizes of a cost file."""
    return sim_trace(name, num_requests, seed, text_tokens=costs.text_tokens(prompt_words),
                     visual_tokens=costs.visual_tokens, **kw)
