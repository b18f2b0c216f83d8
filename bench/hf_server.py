"""The traditional baseline: transformers `generate`, one request at a time, behind an OpenAI-compatible API.

`python -m mserve.bench.hf_server --model DIR --port P [--threads 1]` serves

* ``POST /v1/chat/completions`` (``stream`` true or false; ``max_tokens``, ``temperature``, ``top_p``,
  ``ignore_eos``; images as ``image_url`` data URLs). Streamed replies are SSE: one chunk per generated
  token (``delta.content`` is the new text, ``token_ids`` the token, as vLLM's ``return_token_ids``),
  then a finish chunk, a usage chunk when ``stream_options.include_usage`` is set, and ``data: [DONE]``.
* ``GET /v1/models`` and ``GET /health``.

Requests queue FIFO in front of a single generation thread, the way a plain loop of ``generate`` works:
no batching, no overlap. Prompt ids come from the checkpoint's chat template (mserve.common.prompt.PromptBuilder,
placeholders expanded), pixels from ``AutoImageProcessor(backend="pil")``, so the tokens are exactly
those of the engine tests' Hugging Face oracle. Stdlib HTTP only.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger("mserve.bench.hf_server")


class RequestError(ValueError):
    """A request this server refuses (HTTP 400)."""


@dataclass
class Job:
    kwargs: dict[str, Any]
    config: Any  # transformers.GenerationConfig
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    out: queue.Queue = field(default_factory=queue.Queue)  # ("token", id) ... ("done", reason) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)


class HFGenerator:
    """Model, image processor and prompt builder for one checkpoint; `prepare` a request body, `run` a Job."""

    def __init__(self, model_dir: str, threads: int = 1, device: str = "cpu") -> None:
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        from mserve.common.prompt import PromptBuilder

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = device
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).to(device).eval()
        self.processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        self.builder = PromptBuilder(model_dir)
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def prepare(self, body: dict[str, Any]) -> Job:
        """Validate an OpenAI chat body and turn it into generate() inputs."""
        import copy

        from PIL import Image

        from mserve.common.images import ImageError, image_size_from_header
        from mserve.common.prompt import normalize_messages

        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        try:
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            temperature = float(body.get("temperature") if body.get("temperature") is not None else 1.0)
            top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad sampling parameter: {exc}") from None
        if max_tokens < 1:
            raise RequestError("max_tokens must be >= 1")
        try:
            norm, images = normalize_messages(body.get("messages") or [], allow_paths=False)
            if not all(isinstance(b, bytes) for b in images):
                raise ValueError("video parts are not supported by this baseline server (images and text only)")
            sizes = [image_size_from_header(b) for b in images]
            prompt = self.builder.prepare_normalized(norm, sizes, images)
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        except (ValueError, ImageError, OSError) as exc:
            raise RequestError(str(exc)) from None
        torch = self.torch
        ids = torch.tensor([prompt.prompt_ids], device=self.device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if pil:
            inputs = self.processor(images=pil, return_tensors="pt")
            kwargs["pixel_values"] = inputs["pixel_values"].to(self.device, self.model.dtype)
            if "image_grid_thw" in inputs:
                kwargs["image_grid_thw"] = inputs["image_grid_thw"].to(self.device)
        if self.model.config.model_type in ("qwen2_vl", "qwen2_5_vl"):
            kwargs["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = max_tokens
        config.do_sample = temperature > 0
        if config.do_sample:
            config.temperature, config.top_p = temperature, top_p
        ignore_eos = bool(body.get("ignore_eos", False))
        if ignore_eos:
            config.eos_token_id = None  # EOS may still be picked; it just does not stop generation
        return Job(kwargs, config, len(prompt.prompt_ids), max_tokens, ignore_eos)

    def run(self, job: Job) -> None:
        """generate() with a streamer that hands every new token to the job's queue as it is sampled."""
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        out, torch = job.out, self.torch

        class _Streamer(BaseStreamer):
            prompt_seen = False
            last: int | None = None

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # generate() first pushes the prompt
                    self.prompt_seen = True
                    return
                for tok in value.reshape(-1).tolist():
                    self.last = int(tok)
                    out.put(("token", self.last))

            def end(self) -> None:
                pass

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                return torch.full((input_ids.shape[0],), job.cancelled.is_set(), dtype=torch.bool)

        streamer = _Streamer()
        with torch.inference_mode():
            gen = self.model.generate(**job.kwargs, generation_config=job.config, streamer=streamer,
                                      stopping_criteria=StoppingCriteriaList([_Cancelled()]))
        n = gen.shape[1] - job.kwargs["input_ids"].shape[1]
        stopped_on_eos = not job.ignore_eos and streamer.last in self.eos_ids
        out.put(("done", "stop" if stopped_on_eos or n < job.max_tokens else "length"))


class Detokenizer:
    """Incremental text: each token's delta, holding back an incomplete UTF-8 sequence until it completes.

    The deltas concatenate to exactly decode(all ids) (skip_special_tokens), whatever the split.
    """

    def __init__(self, builder: Any) -> None:
        self.builder = builder
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.builder.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # wait for the rest of the character (or a re-tokenized prefix) before emitting
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def flush(self) -> str:
        text = self.builder.decode(self.ids)
        if text.startswith(self.emitted):
            delta, self.emitted = text[len(self.emitted):], text
            return delta
        return ""


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], generator: HFGenerator, model_name: str) -> None:
        super().__init__(addr, Handler)
        self.generator = generator
        self.model_name = model_name
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.worker = threading.Thread(target=self._work, name="generate", daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue
            try:
                self.generator.run(job)
            except Exception as exc:  # one bad request must not kill the server
                log.exception("generate failed")
                job.out.put(("error", f"{type(exc).__name__}: {exc}"))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug(fmt, *args)

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") == "/health":
            self._json(200, {"status": "ok"})
        elif self.path.rstrip("/") == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model"}]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._error(404, f"no route {self.path}")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            job = self.server.generator.prepare(body)
        except (ValueError, RequestError) as exc:
            return self._error(400, str(exc))
        self.server.jobs.put(job)
        try:
            if body.get("stream"):
                self._stream(job, body)
            else:
                self._complete(job)
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the client left: stop generating for it
        finally:
            self.close_connection = True

    def _complete(self, job: Job) -> None:
        detok = Detokenizer(self.server.generator.builder)
        while True:
            kind, value = job.out.get()
            if kind == "token":
                detok.push(value)
            elif kind == "error":
                return self._error(500, value)
            else:
                break
        detok.flush()
        n = len(detok.ids)
        self._json(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.server.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": detok.emitted},
                         "token_ids": detok.ids, "finish_reason": value}],
            "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": n,
                      "total_tokens": job.prompt_tokens + n}})

    def _stream(self, job: Job, body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.server.model_name

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        def chunk(delta: dict[str, Any], finish: str | None = None, token_ids: list[int] | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [choice]})

        event(chunk({"role": "assistant", "content": ""}))
        gen = self.server.generator
        detok = Detokenizer(gen.builder)
        while True:
            kind, value = job.out.get()
            if kind == "token":
                # The last token carries any held-back text, so every chunk with content is one token.
                last = len(detok.ids) + 1 == job.max_tokens or (not job.ignore_eos and value in gen.eos_ids)
                text = detok.push(value) + (detok.flush() if last else "")
                event(chunk({"content": text}, token_ids=[value]))
            elif kind == "error":
                event(json.dumps({"error": {"message": value, "type": "server_error", "code": 500}}))
                break
            else:
                event(chunk({"content": detok.flush()}, finish=value))
                if (body.get("stream_options") or {}).get("include_usage"):
                    n = len(detok.ids)
                    event(json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                      "choices": [], "usage": {"prompt_tokens": job.prompt_tokens,
                                                               "completion_tokens": n,
                                                               "total_tokens": job.prompt_tokens + n}}))
                break
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mserve.bench.hf_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000; 0 = any free port)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the folder name)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    generator = HFGenerator(args.model, threads=args.threads, device=args.device)
    server = Server((args.host, args.port), generator, args.served_model_name or Path(args.model).name)

    def _stop(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    print(f"hf_server ready on http://{args.host}:{server.server_address[1]}/v1 "
          f"(model {args.model}, {args.threads} thread(s))", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
