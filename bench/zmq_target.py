"""The ZeroMQ target of `mserve bench serve`: one TraceRequest through MServe's AsyncClient, every token timed.

A bench Target (mserve.bench.targets) built on AsyncClient's public API only:

* ``AsyncTokenStream.chunks()`` yields the tokens of each reply as it arrives, so every token is
  stamped with the arrival of the TOKENS message that carried it (tokens of one message share a time).
* ``AsyncClient(poll_interval_s=0.005)``: the client's reader also looks at the socket every 5 ms,
  so a readiness edge consumed by a send (see AsyncClient's docstring) delays a reply by 5 ms at
  most, not the default 50 ms that would show up in the measured latencies. (This used to be a
  watchdog task here that drained the client's socket through its private members every 5 ms.)
"""

from __future__ import annotations

import time
from typing import Any

from mserve.bench.targets import Target

POLL_INTERVAL_S = 0.005


def served_model(result: Any) -> str | None:
    """The model a RESULT says answered it (with a group of variants, the one it was routed to); None from
    a coordinator whose RESULT does not name one (a single-model coordinator)."""
    model = getattr(result, "model", None)
    return model if isinstance(model, str) and model else None


def coordinator_stats(addresses: list[str], timeout_s: float = 2.0) -> dict[str, int] | None:
    """Each coordinator's integer STATUS stats, summed; None if one does not answer."""
    from mserve.coordinator.client import Client, MServeError

    total: dict[str, int] = {}
    for address in addresses:
        try:
            with Client(address, timeout_s=timeout_s) as client:
                stats = client.status().get("stats")
        except (MServeError, OSError):
            return None
        for k, v in (stats or {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total


class ZmqTarget(Target):
    """MServe's AsyncClient: one DEALER (per coordinator shard) for all requests; each TOKENS message's arrival
    is timestamped. ``address``: zmq:// (or tcp://, ipc://), comma-separated for shards, or redis://..."""

    def __init__(self, address: str, *, ignore_eos: bool, timeout_s: float) -> None:
        parts = (a.strip() for a in address.split(","))  # several for sharded coordinators
        self.address = ",".join("tcp://" + a[len("zmq://"):] if a.startswith("zmq://") else a for a in parts)
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.client: Any = None

    async def open(self) -> None:
        from mserve.coordinator.client import AsyncClient

        self.client = AsyncClient(self.address, timeout_s=self.timeout_s, poll_interval_s=POLL_INTERVAL_S)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def counters(self) -> dict[str, int] | None:
        """The coordinators' STATUS `stats` (admitted, reruns, local_prefills, shed, ...), summed over the
        shards; None for a redis:// registry address or when a shard does not answer within 2 s."""
        import asyncio

        addresses = self.address.split(",")
        if any(a.startswith(("redis://", "rediss://")) for a in addresses):
            return None
        return await asyncio.to_thread(coordinator_stats, addresses)

    def prepare(self, req: Any) -> Any:
        """The stream object (request body built, nothing sent): done before the clock starts."""
        return self.client.stream(req.messages, request_id=req.request_id, max_tokens=req.max_tokens,
                                  temperature=0.0, ignore_eos=self.ignore_eos, priority=req.priority,
                                  latency_class=req.latency_class)

    async def run(self, req: Any, stream: Any, rec: Any) -> None:
        from mserve.coordinator.client import MServeError

        times = rec.token_times_s
        rec.start_s = time.perf_counter()
        try:
            async for ids in stream.chunks():  # the request is sent on the first iteration
                now = time.perf_counter()
                times.extend([now] * len(ids))
            rec.end_s = time.perf_counter()
            res = stream.result
            rec.output_tokens = len(res.token_ids)
            rec.prompt_tokens, rec.visual_tokens = res.prompt_tokens, res.visual_tokens
            rec.finish_reason, rec.timings = res.finish_reason, dict(res.timings)
            rec.served_model = served_model(res)
            n_images = len(req.images()) + len(req.videos() if hasattr(req, "videos") else [])
            if req.modality == "document":  # each page an image (image_sizes lists them)
                n_images += len(req.image_sizes)
            n_images += len(req.audio()) if hasattr(req, "audio") else 0  # a clip is an encoder item too
            rec.cache_hits = {"prefix": (int(res.cache_hits.get("prefix_tokens", 0)), res.prompt_tokens)}
            if n_images:
                rec.cache_hits["encoder"] = (int(res.cache_hits.get("embedding", 0)), n_images)
                rec.cache_hits["prefix_skip"] = (int(res.cache_hits.get("skipped_by_prefix", 0)), n_images)
        except MServeError as exc:
            rec.error, rec.error_type = exc.message or str(exc), type(exc).__name__
        except Exception as exc:  # record, never crash the run
            rec.error, rec.error_type = repr(exc), type(exc).__name__
        finally:
            stream.close()
        if rec.first_token_s is None and times:
            rec.first_token_s = times[0]
        if rec.end_s is None:
            rec.end_s = time.perf_counter()
