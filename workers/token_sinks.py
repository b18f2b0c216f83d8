"""Tokens straight to clients: how a decode or unified worker streams a request's tokens without the coordinator.

With the coordinator's ``token_report_every`` N > 1 (docs/scaling.md, "Tokens bypass the
coordinator"), a DECODE or RUN says how the request's tokens leave the worker (`TokenRoute`):

* to the coordinator, only every N tokens, plus the first (it times TTFT) and the last (it ends the
  request with RESULT, which carries every token);
* to the client, when it opened a token sink (a PULL socket it binds; `tokens_to`), every step's
  tokens as the client protocol's TOKENS under the client's request id, pushed from here; and, as the
  request is admitted, the tokens made before it reached this worker (a prefill worker's first token,
  an earlier attempt's), at their own indexes. The client hands tokens out in order, so without them
  its stream would wait for the coordinator's relay of the first token, however many later ones the
  sink already holds: under load the whole stream came out at once, at the end.

The client puts the pieces together by index (client_core.Assembler drops a token it already has
and waits for one that is late), so a re-run that streams some tokens again changes nothing: every
request with sampling carries a seed (the coordinator assigns one), and seeds draw per token index.
A client that went away costs nothing: its PUSH queue fills to its bound and further tokens drop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
import zmq

from mserve.common.protocol import MsgType
from mserve.common.protocol.client import Tokens
from mserve.common.sockets import make_socket, send

log = logging.getLogger("mserve.worker")

MAX_SINKS = 256  # PUSH sockets kept open to clients; the least recently used is closed beyond it


@dataclass
class TokenRoute:
    every: int  # report to the coordinator every this many tokens
    sink: str | None  # the client's token sink, or None: the coordinator relays this request's tokens
    client_rid: str | None
    index: int  # the client-side index of this request's next token
    prompt_tokens: int
    model: str | None = None  # the served model name (the worker's --model-name), sent with index 0
    unreported: list[int] = field(default_factory=list)

    def take(self, tokens: list[int], must_report: bool) -> list[int] | None:
        """Record a step's tokens; those to report to the coordinator now, or None to hold them."""
        self.index += len(tokens)
        self.unreported += tokens
        if not must_report and len(self.unreported) < self.every:
            return None
        out, self.unreported = self.unreported, []
        return out


class TokenSinks:
    """One PUSH socket per client token sink, opened on first use; sends never block the engine loop."""

    def __init__(self, ctx: zmq.Context, max_open: int = MAX_SINKS) -> None:
        self.ctx, self.max_open = ctx, max_open
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.sent = 0
        self.dropped = 0

    def push(self, route: TokenRoute, tokens: list[int], index: int | None = None) -> None:
        """TOKENS for `tokens`, which start at client index `index` (default `route.index`, before `take`
        counts them)."""
        if route.sink is None or not tokens:
            return
        index = route.index if index is None else index
        # At index 0 the prompt's size too: a client that stops early still learns it.
        msg = Tokens(request_id=route.client_rid or "", index=index, token_ids=tokens,
                     prompt_tokens=route.prompt_tokens if index == 0 else None,
                     model=route.model if index == 0 else None)
        try:
            send(self._sock(route.sink), MsgType.TOKENS, msg.to_body(), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as exc:  # its queue is full (a client gone or stalled): RESULT still has them all
            self.dropped += 1
            log.debug("%s: tokens to %s dropped: %s", route.client_rid, route.sink, exc)

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is not None:
            self._socks.move_to_end(address)
            return sock
        if len(self._socks) >= self.max_open:
            _, old = self._socks.popitem(last=False)
            old.close(linger=0)
        sock = self._socks[address] = make_socket(self.ctx, zmq.PUSH, connect=address, hwm=1000)
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
