"""Images through a media store in a real cluster: the coordinator carries none of their bytes, the tokens stay
HF generate's, an image the encoder already holds is never pulled, and a bad ref or a dead holder (a store's
process, or a real gateway, killed mid-request) ends each of its requests exactly once, never a hang, while the
cluster serves on.

One shared cluster (LLAVA_1E1P1D, shm between its workers) serves every test here."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mserve.common.media_store import MediaStore
from mserve.common.protocol.client import MediaRef
from mserve.coordinator.client import BadRequest, Client
from tests.clusters import LLAVA_1E1P1D, LLAVA_2E1P1D_LENDING, LLAVA_UNIFIED
from tests.coordinator.test_cluster import encoders_idle, expected
from tests.helpers import chat, make_image, wait_for
from tests.logged_process import LoggedProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def inline_bytes(c: Client) -> int:
    return c.status()["stats"]["media_bytes_inline"]


def stored_chat(text: str, ref: MediaRef) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "media": ref.fields()}, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)
def test_images_go_through_the_store_not_the_coordinator(shared_cluster, tiny_model_dirs):
    model = str(tiny_model_dirs["llava"])
    image = make_image(120, 90, seed=501)
    requests = [("Describe the picture.", [image]), ("What colour is it?", [image])]
    want = expected(model, requests, MAX_TOKENS)
    with MediaStore() as store, Client(shared_cluster.address, timeout_s=60, media_store=store) as c:
        before = inline_bytes(c)
        first = c.generate(chat(*requests[0]), max_tokens=MAX_TOKENS)
        assert first.token_ids == want[0]
        wait_for(lambda: store.stats()["served"] == 1, what="the encoder's one pull")
        # The same image again: the encoder holds its embeddings, so it never pulls the bytes.
        second = c.generate(chat(*requests[1]), max_tokens=MAX_TOKENS)
        assert second.token_ids == want[1] and second.cache_hits.get("embedding", 0) >= 1
        assert store.stats()["served"] == 1 and store.published == 1
        assert inline_bytes(c) == before  # no image byte went through the coordinator
    with Client(shared_cluster.address, timeout_s=60) as inline:  # the counter does count inline bytes
        inline.generate(chat("Describe the picture.", [make_image(64, 64, seed=502)]), max_tokens=2)
        assert inline_bytes(inline) > before


@pytest.mark.parametrize("shared_cluster", [LLAVA_2E1P1D_LENDING, LLAVA_UNIFIED], ids=["spread", "unified"],
                         indirect=True)
def test_spread_encodes_and_unified_workers_pull_from_the_store(shared_cluster):
    """Two images: two idle encoders each pull their part (a spread encode), or the unified worker pulls both."""
    cluster, encoders = shared_cluster, shared_cluster.counts["encode"]
    request = ("Compare the pictures.", [make_image(100, 70, seed=505), make_image(70, 100, seed=506)])
    if encoders:
        wait_for(lambda: encoders_idle(cluster.address, encoders), timeout_s=30, what="both encoders idle")
    with MediaStore() as store, Client(cluster.address, timeout_s=60, media_store=store) as c:
        before = c.status()["stats"]
        result = c.generate(chat(*request), max_tokens=MAX_TOKENS)
        after = c.status()["stats"]
        wait_for(lambda: store.stats()["served"] == 2, what="each image pulled once")
    assert result.token_ids == expected(cluster.model, [request], MAX_TOKENS)[0]
    assert after["media_bytes_inline"] == before["media_bytes_inline"]
    assert (after["spread_encodes"] - before["spread_encodes"] >= 1) == bool(encoders)


HOLDER = """
import json, sys, time
from mserve.common.media_store import MediaStore
from tests.helpers import make_image
store = MediaStore(backend="tcp")  # tcp: the bytes die with the process (an shm segment would outlive it)
print(json.dumps(store.put_image(make_image(80, 60, seed=503)).fields()), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)
def test_a_bad_ref_or_a_dead_holder_fails_the_request_clearly(shared_cluster):
    with MediaStore() as store, Client(shared_cluster.address, timeout_s=60) as c:
        ref = store.put_image(make_image(96, 72, seed=504))
        lie = dataclasses.replace(ref, size=[72, 96])  # admitted (and counted) as 72x96: the bytes say 96x72
        with pytest.raises(BadRequest, match="do not match its header facts.*the image is 96x72"):
            c.generate(stored_chat("Describe the picture.", lie), max_tokens=MAX_TOKENS)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
        try:
            dead = MediaRef.from_body(json.loads(holder.stdout.readline()))
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
        with pytest.raises(BadRequest, match=f"image {dead.hash} in the media store at .* could not be pulled"):
            c.generate(stored_chat("Describe the picture.", dead), max_tokens=MAX_TOKENS)
        assert c.generate(stored_chat("Describe the picture.", ref), max_tokens=2).token_ids  # serving goes on


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)
def test_a_video_file_goes_through_the_store_sampled_from_its_facts(shared_cluster):
    """A video file in the store: admission samples its frames from the ref's facts (frames, fps, size), the
    encoder pulls the file and decodes those frames; HF generate's tokens, none of its bytes inline."""
    from mserve.common.prompt import PromptBuilder
    from mserve.common.video import decode_video_file
    from tests.coordinator.test_cluster_video import png
    from tests.helpers import hf_generate_visual, make_frames, make_video_file

    model, clip = shared_cluster.model, make_video_file(make_frames(112, 84, 6, seed=24), fps=4)
    req = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": "What happens?"}]}]
    with MediaStore() as store, Client(shared_cluster.address, timeout_s=60, media_store=store) as c:
        before = inline_bytes(c)
        result = c.generate(req, max_tokens=MAX_TOKENS)
        assert inline_bytes(c) == before and store.stats()["items"] == 1
    pp = PromptBuilder(model).prepare(req)
    decoded = [png(f) for f in decode_video_file(clip, pp.images[0].indices)]
    assert result.token_ids == hf_generate_visual(model, pp.prompt_ids, [decoded], MAX_TOKENS)


HOLDER_OF_THREE = """
import json, time
from mserve.common.media_store import MediaStore
from tests.helpers import make_image
store = MediaStore(backend="tcp")  # tcp: the bytes die with the process (an shm segment would outlive it)
for seed in (507, 508, 510):
    print(json.dumps(store.put_image(make_image(88, 66, seed=seed)).fields()), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)
def test_kill_9_of_the_stores_holder_mid_request_ends_each_request_once(shared_cluster):
    """The process holding the store is killed outright while its requests wait on the encoder (frozen with
    SIGSTOP, so they surely are accepted and dispatched, not yet pulled): a request whose image the encoder
    pulled before the kill ends with HF generate's tokens, one whose image was never pulled ends with an
    error naming the item and its store (bounded by the worker's fetch timeout, never a hang), each exactly
    once, and the cluster serves a new store's request on."""
    import asyncio

    from mserve.coordinator.client import AsyncClient

    cluster, model = shared_cluster, shared_cluster.model
    encode = cluster.worker_names("encode")[0]
    held_image = make_image(88, 66, seed=507)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_OF_THREE], stdout=subprocess.PIPE, text=True)
    try:
        held, *lost = (MediaRef.from_body(json.loads(holder.stdout.readline())) for _ in range(3))
        with Client(cluster.address, timeout_s=60) as c:
            before = c.status()["stats"]
            warm = c.generate(stored_chat("Describe the picture.", held), max_tokens=MAX_TOKENS)  # pulled: held
        sent = [("What colour is it?", held), ("Is it bright?", held), ("What is in it?", lost[0]),
                ("What is in it?", lost[1])]

        async def run() -> list:
            async with AsyncClient(cluster.address, timeout_s=60) as client:
                cluster.kill_worker(encode, signal.SIGSTOP)
                try:
                    tasks = [asyncio.ensure_future(client.generate(stored_chat(t, ref), max_tokens=MAX_TOKENS))
                             for t, ref in sent]
                    deadline = asyncio.get_running_loop().time() + 3  # well inside --dead-after-s (5 s)
                    while True:  # all accepted, the lost image's encode dispatched to the frozen encoder
                        status = await client.status()
                        if (status["stats"]["admitted"] - before["admitted"] == 1 + len(sent)
                                and status["workers"][encode]["load"]["inflight"] >= 1):
                            break
                        assert asyncio.get_running_loop().time() < deadline, status["stats"]
                        await asyncio.sleep(0.01)
                    holder.send_signal(signal.SIGKILL)
                    holder.wait()
                finally:
                    cluster.kill_worker(encode, signal.SIGCONT)
                return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)  # none hangs

        outcomes = asyncio.run(run())
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
    want = expected(model, [("Describe the picture.", [held_image])] + [(t, [held_image]) for t, _ in sent[:2]],
                    MAX_TOKENS)
    assert [warm.token_ids] + [r.token_ids for r in outcomes[:2]] == want
    for ref, outcome in zip(lost, outcomes[2:]):  # the first waits out the fetch timeout, the second not
        assert isinstance(outcome, BadRequest), outcome
        assert re.search(f"image {ref.hash} in the media store at .* could not be pulled \\(its holder is gone",
                         str(outcome)), outcome
    with Client(cluster.address, timeout_s=60) as c:
        after = wait_for(lambda: (s := c.status())["requests_in_flight"] == 0 and s, what="nothing left in flight")
        ended = {k: after["stats"][k] - before[k] for k in ("admitted", "completed", "failed")}
        assert ended == {"admitted": 5, "completed": 3, "failed": 2}  # each accepted request ended exactly once
        fresh = make_image(72, 96, seed=509)
        with MediaStore() as store, Client(cluster.address, timeout_s=60, media_store=store) as again:
            result = again.generate(chat("Describe the picture.", [fresh]), max_tokens=MAX_TOKENS)
    assert result.token_ids == expected(model, [("Describe the picture.", [fresh])], MAX_TOKENS)[0]


class Gateway(LoggedProcess):
    """A real `mserve gateway` (its media store on, the default) on a free port of 127.0.0.1, in its own process:
    not the cluster's start_gateway, which counts it among the shared cluster's processes (a dead one there
    makes the next user restart the whole cluster). Spawned at once; `ready` waits for its /health."""

    def __init__(self, address: str, model: str, log: Path) -> None:
        from mserve.common.sockets import free_port

        port = free_port()
        super().__init__([sys.executable, "-m", "mserve.cli", "gateway", "--coordinator", address, "--host",
                          "127.0.0.1", "--port", str(port), "--model", model, "--served-model-name", "tiny"], log)
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> Gateway:
        import httpx

        def healthy() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout_s=60, what="the gateway's /health", every_s=0.1)
        return self

    def chat(self, text: str, image: bytes, stream: bool = False) -> list:
        """One image request's token ids (non-streaming), or its stream's lines."""
        import httpx

        url = "data:image/png;base64," + base64.b64encode(image).decode()
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "return_token_ids": True, "stream": stream,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": text}]}]}
        if not stream:
            reply = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
            reply.raise_for_status()
            return reply.json()["choices"][0]["token_ids"]
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60) as reply:
            return list(reply.iter_lines())


def shm_segments_of(pid: int) -> list[str]:
    """The shared-memory segments a process created (common/transfer/shm_pool.py names them after it)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("mserve_") and n.split("_")[2:3] == [str(pid)]]


@pytest.mark.parametrize("shared_cluster", [LLAVA_1E1P1D], indirect=True)
def test_kill_9_of_the_uploading_gateway_mid_request_ends_each_request_once(shared_cluster, tmp_path):
    """A real gateway is killed outright while its image requests (in its media store's shm segments, GENERATE
    carrying only their refs; two plain, one streamed) wait on the encoder, frozen with SIGSTOP so they surely
    are admitted and dispatched but not pulled. Each HTTP caller sees its connection drop. The coordinator has
    no notion of a client link dying: nothing cancels the gateway's requests; it learns of the gateway only
    when a reply to its identity is refused (ROUTER_MANDATORY), and drops that reply. So each request runs on
    to its end: the encoder pulls its image from the dead gateway's segment. The gateway's multiprocessing
    resource tracker (a child that outlives it) unlinks its segments as soon as it dies, so a pull fails at
    once, naming the item and its store; had the tracker died too (its whole group killed), the segments would
    outlive it until a sweep (a pull that finds their owner gone, or any transfer engine starting on the host)
    and a pull before it would complete the request. Either way each request ends exactly once, within one
    fetch timeout, never hangs, and leaves no KV block used; a fresh gateway then serves an image request with
    HF generate's tokens, and nothing of the dead one's shared memory is left."""
    import httpx

    cluster, model = shared_cluster, shared_cluster.model
    encode = cluster.worker_names("encode")[0]
    warm_image, fresh = make_image(84, 64, seed=511), make_image(64, 84, seed=515)
    sent = [("What colour is it?", make_image(88, 66, seed=512), False),
            ("Is it bright?", make_image(66, 88, seed=513), False),
            ("What is in it?", make_image(80, 80, seed=514), True)]
    with Client(cluster.address, timeout_s=10) as c:
        wait_for(lambda: c.status()["requests_in_flight"] == 0, what="nothing in flight before the test")
        before = c.status()["stats"]
    with Gateway(cluster.address, model, tmp_path / "gateway.log") as gateway:
        want = expected(model, [("Describe the picture.", [warm_image]), ("Describe the picture.", [fresh])],
                        MAX_TOKENS)  # while the gateway starts
        warm = gateway.ready().chat("Describe the picture.", warm_image)  # its request path is hot
        with Client(cluster.address, timeout_s=10) as c, ThreadPoolExecutor(len(sent)) as callers:
            cluster.kill_worker(encode, signal.SIGSTOP)
            try:
                calls = [callers.submit(gateway.chat, text, image, stream) for text, image, stream in sent]
                deadline = time.monotonic() + 3  # well inside --dead-after-s (5 s)
                while True:  # all admitted, an encode dispatched to the frozen encoder
                    status = c.status()
                    if (status["stats"]["admitted"] - before["admitted"] == 1 + len(sent)
                            and status["workers"][encode]["load"]["inflight"] >= 1):
                        break
                    assert time.monotonic() < deadline, status["stats"]
                    time.sleep(0.01)
                assert shm_segments_of(gateway.proc.pid)  # the images wait in the gateway's shared memory
                gateway.proc.send_signal(signal.SIGKILL)
                gateway.proc.wait()
                killed_at = time.monotonic()
            finally:
                cluster.kill_worker(encode, signal.SIGCONT)
            for call in calls:  # none was answered before the kill: each caller's connection drops
                with pytest.raises(httpx.TransportError):
                    call.result(timeout=10)
            after = wait_for(lambda: (s := c.status())["requests_in_flight"] == 0 and s, timeout_s=30,
                             what="the dead gateway's requests to end")
            assert time.monotonic() - killed_at < 10 + 5  # within one fetch timeout (the workers' 10 s): no hang
    ended = {k: after["stats"][k] - before[k] for k in ("admitted", "completed", "failed")}
    assert ended["admitted"] == 1 + len(sent) and ended["completed"] + ended["failed"] == ended["admitted"], ended
    with Gateway(cluster.address, model, tmp_path / "fresh-gateway.log") as again:

        def kv_free() -> bool:
            with Client(cluster.address, timeout_s=10) as c:
                workers = c.status()["workers"].values()
            return all(w["counters"].get("used_blocks", 0) == 0 for w in workers if w["role"] != "encode")

        wait_for(kv_free, what="every KV block free again")  # while the fresh gateway starts
        with Client(cluster.address, timeout_s=10) as c:
            inline = inline_bytes(c)
            result = again.ready().chat("Describe the picture.", fresh)
            assert inline_bytes(c) == inline  # through the fresh gateway's store, not inline
    assert [warm, result] == want
    assert not shm_segments_of(gateway.proc.pid)  # unlinked: by its tracker, a pull, or the fresh gateway's start
