"""One chat completion's token stream from the coordinator, turned into OpenAI text deltas (the gateway's
routes in gateway/app.py stream or gather them)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mserve.common import tracing
from mserve.gateway.openai_api import ChatRequest
from mserve.gateway.textstream import Detokenizer, StopMatcher

if TYPE_CHECKING:
    from mserve.gateway.app import Gateway


class Generation:
    """One chat completion's tokens turned into text deltas, stop strings applied."""

    def __init__(self, gw: Gateway, req: ChatRequest, model: str, span: Any = None) -> None:
        self.req = req
        self.catalog = gw.catalog
        self.model = model  # the coordinator's name asked for; once a reply names it, the model answering
        self.span = span  # the request's gateway span while tracing is on (common/tracing.py)
        trace = {"trace": tracing.traceparent(span)} if span is not None else {}
        self.stream = gw.client.stream(req.messages, timeout_s=gw.settings.request_timeout_s, model=model,
                                       **req.sampling, **trace)
        self.detok: Detokenizer = None  # type: ignore[assignment]  # the answering model's, at its first reply
        self.stops = StopMatcher(req.stop)
        self._chunks = self.stream.chunks()
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.visual_keep_ratio: float | None = None  # from the RESULT: SLO-adaptive pruning pruned it
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    async def next_delta(self) -> tuple[str, list[int]] | None:
        """The next (text, token ids) piece, or None when the request is over (``finish_reason`` set)."""
        if self.finish_reason is not None:
            return None
        try:
            ids = await self._chunks.__anext__()
        except StopAsyncIteration:
            res = self.stream.result
            assert res is not None
            await self._answered_by(res.model)
            self.prompt_tokens, self.finish_reason = res.prompt_tokens, res.finish_reason
            self.visual_keep_ratio = res.visual_keep_ratio
            tail = self.stops.feed(self.detok.finish(res.text))
            tail += self.stops.flush()
            if self.stops.stopped:
                self.finish_reason = "stop"
            return tail, []
        if self.t_first is None:
            self.t_first = time.perf_counter()
        await self._answered_by(self.stream.model)
        self.prompt_tokens = self.stream.prompt_tokens or self.prompt_tokens
        text = self.stops.feed(self.detok.add(ids))
        if self.stops.stopped:  # a stop string ended the answer: stop the cluster's work too
            self.finish_reason = "stop"
            self.close()
        return text, ids

    async def _answered_by(self, served: str | None) -> None:
        """The first reply names the model answering (a group's variant): its tokenizer reads the tokens."""
        if self.detok is None:
            self.model = served or self.model
            self.detok = Detokenizer(await self.catalog.tokenizer(self.model))

    @property
    def public_model(self) -> str:
        """The answering model as clients name it (the request's own name until a reply said)."""
        return self.catalog.public(self.model) if self.detok is not None else self.req.model

    @property
    def completion_tokens(self) -> int:
        return len(self.detok.ids) if self.detok is not None else 0

    def close(self) -> None:
        self.stream.close()
