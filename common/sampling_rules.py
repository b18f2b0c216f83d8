"""Each sampling default and bound, written once.

The wire's `Sampling` and `Generate` (common/protocol/client.py), the Python clients, admission's
pydantic check (coordinator/admission.py), the OpenAI gateway (mserve/gateway/openai_api.py) and the
engine's `SamplingParams` (workers/sequence.py) all take their defaults and limits from here, so a
request means the same thing whichever door it comes in by.

`max_tokens` defaults to 256 everywhere. OpenAI's chat API has no fixed default (it generates until
the model stops or the context is full); vLLM's Python API defaults to 16, which truncates most
answers. 256 finishes a typical chat answer while bounding the KV a request that names nothing can
hold. The largest `max_tokens` a server accepts is a limit, not a sampling rule (common/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 256
TEMPERATURE = 0.0  # greedy
TOP_K = 0  # off
TOP_P = 1.0  # off
PRIORITY = 0


@dataclass(frozen=True)
class Bound:
    """lo <= value (lo < value when `lo_open`) and value <= hi; None: that side is unbounded."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def ok(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        """'>= 1', '<= 2', 'in (0, 1]', 'in [-100, 100]'."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.lo is None:
            return f"<= {self.hi}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"

    def pydantic(self) -> dict[str, Any]:
        """The same bound as pydantic Field keywords."""
        out: dict[str, Any] = {}
        if self.lo is not None:
            out["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            out["le"] = self.hi
        return out


BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1),
    "temperature": Bound(0, 2),  # OpenAI's range; above 2 the distribution is close to uniform noise
    "top_k": Bound(0),
    "top_p": Bound(0, 1, lo_open=True),
    "priority": Bound(-100, 100),  # higher first
}


def check(name: str, value: float) -> None:
    """Raise ValueError('<name> must be <bound>, got <value>') when `value` is outside `name`'s bound."""
    bound = BOUNDS[name]
    if not bound.ok(value):
        raise ValueError(f"{name} must be {bound.describe()}, got {value!r}")
