"""One client request's decisions, without I/O (sans-IO): what both clients' generate / stream / retry decide.

``Client`` (client.py) and ``AsyncClient`` (async_client.py) are I/O loops around these objects: they
send, wait and read; ``ClientRequest`` decides the GENERATE body, the deadline, when a silent request
is probed, when its shard is given up on and which error a failed send or a timeout raises, and
``Attempts`` which shard gets generate()'s next try and when to stop trying. Nothing here touches a
socket or an event loop; the clock is passed in.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generic, Iterator, Sequence, TypeVar

from mserve.common.protocol import MsgType
from mserve.coordinator.client_core import (Assembler, MServeError, Reply, RequestTimeout, ShardChooser, client_api_key,
                                            error_from_reply, generate_body, shard_gone_reply)

if TYPE_CHECKING:  # the store loads torch; a client without one does not
    from mserve.common.media_store import MediaStore

__all__ = ["ClientRequest", "Attempts", "RequestMaker"]

S = TypeVar("S")  # a client's token stream: TokenStream (Client) or AsyncTokenStream (AsyncClient)


class ClientRequest:
    """One GENERATE: its body, shard, deadline, probes and reply assembly (``asm``).

    The I/O loop calls ``begin`` just before sending ``body`` to ``shard`` (bounded by ``send_until``;
    ``unsent`` is what to raise when it did not go out), then waits for replies until ``wait_until``;
    each time that passes with nothing heard it calls ``silent``, which says: raise (the deadline
    passed), end with the returned Lost reply (its shard is taken for dead), or probe the shard (None).
    """

    def __init__(self, shards: ShardChooser, request_id: str, body: dict[str, Any], timeout_s: float,
                 probe_after_s: float, reorder: bool) -> None:
        self.request_id = request_id
        self.body = body
        self.timeout_s = timeout_s
        self.asm = Assembler(request_id, reorder=reorder)
        self.shard: str | None = None  # the coordinator shard's address, picked by begin()
        self.deadline = 0.0  # for the whole request, from begin()
        self._shards = shards
        self._probe_after_s = probe_after_s  # a request this silent is checked with its coordinator
        self._probes: list[float] = []  # when the probes not (yet) answered were sent

    def begin(self, now: float) -> str:
        """Pick the shard and start the deadline; the address to send ``body`` to."""
        self.shard = self._shards.pick(self.request_id, now)
        self.deadline = now + self.timeout_s
        return self.shard

    def send_until(self, now: float) -> float:
        """How long sending the GENERATE may wait (a send waits while the coordinator is unreachable)."""
        return self._shards.send_until(self.deadline, self._probe_after_s, now)

    def unsent(self, until: float, now: float) -> MServeError:
        """The error for a GENERATE not sent by ``until``: with shards before the deadline, the shard is
        taken for dead and the request Lost (generate() tries another); else a timeout."""
        assert self.shard is not None
        if until < self.deadline:
            self._shards.mark_down(self.shard, now)
            return error_from_reply(shard_gone_reply(self.request_id, self.shard)[1])
        return RequestTimeout(f"coordinator at {self.shard} is not reachable", request_id=self.request_id)

    def wait_until(self, now: float) -> float:
        """How long to wait for the next reply before ``silent`` decides what the silence means."""
        return min(self.deadline, now + self._probe_after_s)

    def silent(self, now: float, last_heard: float) -> tuple[MsgType, Reply] | None:
        """Nothing came by ``wait_until``: raise RequestTimeout past the deadline; the Lost reply that ends
        the request once its shard left SHARD_PROBES_UNANSWERED probes in a row unanswered (nothing heard
        from it since ``last_heard``; with shards only); else None, and the caller probes the shard."""
        if now >= self.deadline:
            raise RequestTimeout(f"no result within {self.timeout_s}s; request aborted", request_id=self.request_id)
        assert self.shard is not None
        self._probes = [t for t in self._probes if t > last_heard]
        if self._shards.gives_up(self.shard, len(self._probes), now):
            return shard_gone_reply(self.request_id, self.shard)
        self._probes.append(now)
        return None


class Attempts:
    """generate()'s tries of one request: one per shard, each given what is left of one deadline.

    ``for timeout_s in attempts: try: return <run the request once> except Lost as exc: attempts.lost(exc)``;
    ``lost`` raises unless another shard may take the request."""

    def __init__(self, shards: ShardChooser, request_id: str, timeout_s: float) -> None:
        self.request_id = request_id
        self._shards = shards
        self._deadline = time.monotonic() + timeout_s
        self._tries_left = 0

    def __iter__(self) -> Iterator[float]:
        for self._tries_left in self._shards.tries():
            yield self._deadline - time.monotonic()
        raise AssertionError("unreachable: the last try's lost() raises")

    def lost(self, exc: MServeError) -> None:
        self._shards.resend_or_raise(self.request_id, exc, self._tries_left)


class RequestMaker(Generic[S]):
    """What both clients share above the I/O: their settings, ``stream()``, and how they make a
    ``ClientRequest``. A client opens a stream of one in ``_open`` (its own I/O)."""

    def _setup(self, address: str, timeout_s: float, probe_after_s: float, api_key: str | None,
               media_store: MediaStore | None) -> None:
        self.address = address
        # Images go into this store and GENERATE carries their refs (common/media_store.py); None: inline.
        self.media_store = media_store
        self._shards = ShardChooser(address)
        self._api_key = client_api_key(api_key)  # sent in every message; default $MSERVE_CLIENT_API_KEY
        self.timeout_s = timeout_s
        self.probe_after_s = probe_after_s  # a request this silent is checked with its coordinator

    def stream(self, messages: Sequence[dict[str, Any]], *, timeout_s: float | None = None,
               request_id: str | None = None, **sampling: Any) -> S:
        """Like generate(), but yields token ids as they arrive (``async for`` them from an AsyncClient, whose
        request is sent on the first iteration); ``.result`` is set once exhausted."""
        return self._open(messages, True, timeout_s, request_id, sampling)

    def _open(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None,
              request_id: str | None, sampling: dict[str, Any]) -> S:
        raise NotImplementedError

    def _attempts(self, request_id: str, timeout_s: float | None) -> Attempts:
        return Attempts(self._shards, request_id, self.timeout_s if timeout_s is None else timeout_s)

    def _request(self, messages: Sequence[dict[str, Any]], stream: bool, timeout_s: float | None, request_id: str,
                 sampling: dict[str, Any], tokens_to: str | None) -> ClientRequest:
        """The request to send; ``tokens_to``: this client's token sink (direct_tokens), for streams only."""
        body = generate_body(request_id, messages, stream, **sampling)
        if self.media_store is not None:
            body = self.media_store.store_messages(body)
        if stream and tokens_to is not None:
            body["tokens_to"] = tokens_to
        return ClientRequest(self._shards, request_id, body, self.timeout_s if timeout_s is None else timeout_s,
                             self.probe_after_s, reorder=tokens_to is not None)
