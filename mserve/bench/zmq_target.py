"""The ZeroMQ target of `mserve bench serve`: one TraceRequest through MServe's AsyncClient, every token timed.

Workaround kept here until coordinator/client.py fixes it: AsyncClient's reader task waits on the
DEALER's edge-triggered ZMQ_FD, but the client's sends go through the same socket, and a send makes
libzmq process pending commands, which can consume the read edge while replies sit unread. The
reader then sleeps forever. Seen intermittently with AsyncClient alone: requests streamed at 100 req/s
to a unified tiny cluster, 37 of 200 completed and the rest timed out although the coordinator had
answered every one. So after every send, and every 5 ms in a watchdog, the target drains whatever
zmq.EVENTS says is readable, exactly as the reader loop would (0 losses in 10 runs of 200-2500 requests).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class ZmqTarget:
    """MServe's AsyncClient: one DEALER for all requests; each TOKENS message's arrival is timestamped."""

    def __init__(self, address: str, *, ignore_eos: bool, timeout_s: float) -> None:
        self.address = "tcp://" + address.split("://", 1)[1] if address.startswith("zmq://") else address
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.client: Any = None
        self._watchdog: asyncio.Task | None = None

    async def open(self) -> None:
        from mserve.coordinator.client import AsyncClient

        self.client = AsyncClient(self.address, timeout_s=self.timeout_s)
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.client is not None:
            await self.client.close()

    def _drain(self) -> None:
        import zmq

        from mserve.coordinator.client import _recv_valid

        client = self.client
        if client is None or client._closed:
            return
        while client._sock.get(zmq.EVENTS) & zmq.POLLIN:
            reply = _recv_valid(client._sock, zmq.NOBLOCK)
            if reply is not None:
                client._dispatch(*reply)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.005)
            self._drain()

    def prepare(self, req: Any) -> Any:
        """The stream object (request body built, nothing sent): done before the clock starts."""
        return self.client.stream(req.messages, request_id=req.request_id, max_tokens=req.max_tokens,
                                  temperature=0.0, ignore_eos=self.ignore_eos, priority=req.priority,
                                  latency_class=req.latency_class)

    async def run(self, req: Any, stream: Any, rec: Any) -> None:
        from mserve.coordinator.client import MServeError

        times = rec.token_times_s
        asm = getattr(stream, "_asm", None)
        rec.start_s = time.perf_counter()
        try:
            if hasattr(stream, "_start"):  # send now, so the reader can be nudged right after the send
                await stream._start()
                self._drain()
            while True:
                # A token already buffered came in the same TOKENS message as the previous one: same arrival.
                buffered = asm is not None and len(asm.ready) > 0
                try:
                    await stream.__anext__()
                except StopAsyncIteration:
                    break
                times.append(times[-1] if buffered and times else time.perf_counter())
            rec.end_s = time.perf_counter()
            res = stream.result
            rec.output_tokens = len(res.token_ids)
            rec.prompt_tokens, rec.visual_tokens = res.prompt_tokens, res.visual_tokens
            rec.finish_reason, rec.timings = res.finish_reason, dict(res.timings)
            n_images = len(req.images())
            rec.cache_hits = {"prefix": (int(res.cache_hits.get("prefix_tokens", 0)), res.prompt_tokens)}
            if n_images:
                rec.cache_hits["encoder"] = (int(res.cache_hits.get("embedding", 0)), n_images)
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
