"""The client of the multi-host test: runs on host A (inside its namespaces) and takes commands from
the test over stdin, one JSON object per line; every reply is one JSON line on stdout carrying the
command's ``id``. Commands run concurrently, so the test can read STATUS while requests stream.

    {"id": 1, "op": "status"}                      -> {"id": 1, "status": {...}}   (coordinator STATUS)
    {"id": 2, "op": "registry"}                    -> {"id": 2, "workers": {...}}  (Redis worker registry)
    {"id": 3, "op": "generate", "requests": [{"text": ..., "images": [base64, ...]}, ...],
     "max_tokens": N, "ignore_eos": bool}          -> {"id": 3, "results": [{"streamed": [...],
                                                       "token_ids": [...], "attempts": n,
                                                       "finish_reason": ...} or {"error": ...}]}

Every request of a ``generate`` is streamed at once over one AsyncClient. A command that raises is
answered ``{"id": ..., "error": "..."}``. EOF on stdin ends the driver.

Usage: python -m tests.multihost.driver CLIENT_ADDRESS REDIS_URL
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from typing import Any

from mserve.common.redis_store import RedisStore
from mserve.coordinator.client import AsyncClient  # no torch: the driver starts in well under a second


def chat(text: str, images: list[bytes]) -> list[dict[str, Any]]:
    """tests.helpers.chat, without importing torch: one user turn, images first, then the text."""
    content = [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


async def _generate(client: AsyncClient, cmd: dict[str, Any]) -> dict[str, Any]:
    async def one(req: dict[str, Any]) -> dict[str, Any]:
        images = [base64.b64decode(b) for b in req.get("images", [])]
        stream = client.stream(chat(req["text"], images), max_tokens=cmd["max_tokens"],
                               ignore_eos=cmd.get("ignore_eos", False))
        streamed: list[int] = []
        try:
            async for tok in stream:
                streamed.append(tok)
        except Exception as exc:  # reported, not raised: the test asserts on every request
            return {"error": f"{type(exc).__name__}: {exc}", "streamed": streamed}
        r = stream.result
        return {"streamed": streamed, "token_ids": r.token_ids, "attempts": r.attempts,
                "finish_reason": r.finish_reason}

    return {"results": await asyncio.gather(*[one(r) for r in cmd["requests"]])}


async def _handle(client: AsyncClient, store: RedisStore, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    if op == "status":
        return {"status": await client.status(timeout_s=cmd.get("timeout_s", 5.0))}
    if op == "registry":
        return {"workers": await asyncio.to_thread(store.list_workers)}
    if op == "generate":
        return await _generate(client, cmd)
    raise ValueError(f"unknown op {op!r}")


async def main(address: str, redis_url: str, out: Any) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)  # a command carries its images
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    store = RedisStore(redis_url)
    tasks: set[asyncio.Task[None]] = set()

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    async def run(cmd: dict[str, Any]) -> None:
        try:
            reply({"id": cmd.get("id"), **await _handle(client, store, cmd)})
        except Exception as exc:
            reply({"id": cmd.get("id"), "error": f"{type(exc).__name__}: {exc}"})

    async with AsyncClient(address, timeout_s=120) as client:
        reply({"id": 0, "ready": True})
        while line := await reader.readline():
            task = asyncio.create_task(run(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
    store.close()


if __name__ == "__main__":
    # Replies go to the real stdout alone; anything else printing goes to stderr (the driver's log).
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    asyncio.run(main(sys.argv[1], sys.argv[2], protocol_out))
