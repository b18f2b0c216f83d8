"""The OpenAI-compatible HTTP gateway: FastAPI routes over one AsyncClient to the coordinator.

``POST /v1/chat/completions`` (SSE streaming exactly as OpenAI sends it, or one JSON body),
``GET /v1/models`` (every model the coordinator serves: gateway/models.py), ``GET /health``, ``GET /metrics``,
``GET /dashboard`` (a live page of the same numbers: gateway/dashboard.py). Errors are OpenAI's error JSON with the
status a client expects (400, 401, 404, 413, 429 + Retry-After, 503, 504). A client that goes
away aborts its request on every stage: the token stream is closed, which sends ABORT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from mserve.common import tracing
from mserve.common.documents import DocumentLimits
from mserve.common.perf import freeze_startup_heap
from mserve.coordinator.async_client import AsyncClient
from mserve.coordinator.client_core import MServeError
from mserve.gateway.dashboard import Dashboard, page
from mserve.gateway.generation import Generation
from mserve.gateway.media_fetch import fetcher_from_settings
from mserve.gateway.metrics import GatewayMetrics
from mserve.gateway.models import ModelCatalog
from mserve.gateway.openai_api import ApiError, ChatRequest, has_documents, parse_chat_request, status_for_code
from mserve.gateway.openai_responses import (KEEP_RATIO_HEADER, MODEL_HEADER, chat_response, chunk, completion_id,
                                             pruned_marker, usage_of)
from mserve.gateway.settings import GatewaySettings

log = logging.getLogger("mserve.gateway")
T = TypeVar("T")
_DISCONNECT_POLL_S = 0.2
# A body that may hold an http(s) URL string is parsed in a thread (its media are fetched there): a
# string starting "http, or any \u escape (which could spell one). base64 holds neither '"' nor '\',
# so a body of data URLs does not match and parses on the event loop as before.
_REMOTE_URL = re.compile(rb'"[hH][tT][tT][pP]|\\u')


class ClientGone(Exception):
    """The HTTP client disconnected; its request has been aborted."""


def _api_error(exc: MServeError) -> ApiError:
    status, type_ = status_for_code(exc.code)
    return ApiError(status, exc.message, type_=type_, code=exc.code, retry_after_s=exc.retry_after_s)


def _error_response(exc: ApiError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the HTTP client leaves first, cancel it (which aborts the request) and raise."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.media_root = Path(settings.allowed_media_path).resolve() if settings.allowed_media_path else None
        self.fetcher = fetcher_from_settings(settings)
        # Fetches block a thread each (media_fetch.py); their own pool, so they never queue behind others.
        self._media_pool = ThreadPoolExecutor(settings.media_max_concurrent_fetches + 4,
                                              thread_name_prefix="media-fetch")
        self.documents = DocumentLimits(max_pages=settings.max_document_pages,
                                        **({} if settings.document_dpi is None else {"dpi": settings.document_dpi}))
        self.client: AsyncClient = None  # type: ignore[assignment]  # made in the app's event loop
        self.media_store: Any = None  # unless --media-store-host none (common/media_store.py)
        self.catalog: ModelCatalog = None  # type: ignore[assignment]
        self.metrics = GatewayMetrics()
        self.dashboard = Dashboard(lambda: self.client.status(timeout_s=2.0))

    async def start(self) -> None:
        # 5 ms: how late a reply can be read when a send consumed the socket's readable edge.
        key = self.settings.coordinator_api_key
        self.client = AsyncClient(self.settings.coordinator, timeout_s=self.settings.request_timeout_s,
                                  poll_interval_s=0.005, api_key=key.get_secret_value() if key else None,
                                  direct_tokens=self.settings.direct_tokens, tokens_host=self.settings.tokens_host,
                                  media_store=self._media_store())
        self.catalog = ModelCatalog(lambda: self.client.status(timeout_s=30.0), self.settings.served_model_name,
                                    self.settings.model)
        await self.catalog.refresh()
        if self.catalog.default is not None:  # the default model's folder must be readable here: fail at start
            await self.catalog.tokenizer(self.catalog.default)
        freeze_startup_heap()
        log.info("gateway for %s ready, serving %s", self.settings.coordinator, self.catalog.names())

    def _media_store(self) -> Any:
        """The media store request media go into (--media-store-host), None (`none`): they go inline."""
        if self.settings.media_store_host is None:
            return None
        from mserve.common.media_store import MediaStore  # loads torch: only when the store is on
        from mserve.common.sockets import is_loopback

        host = self.settings.media_store_host
        if is_loopback(host) and not is_loopback(self.settings.host):
            log.warning("media store on %s: only workers on this host can pull from it; with workers on other "
                        "hosts set --media-store-host to an address of this host they reach (or none)", host)
        self.media_store = MediaStore(host)
        return self.media_store

    async def close(self) -> None:
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            await self.client.close()
        if self.media_store is not None:
            self.media_store.close()

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key.get_secret_value() if self.settings.api_key else ""
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type_="authentication_error", code="invalid_api_key")

    async def read_chat_request(self, request: Request) -> ChatRequest:
        raw = await self.read_body(request)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        documents = has_documents(body)
        parse = functools.partial(parse_chat_request, body, media_root=self.media_root, fetcher=self.fetcher,
                                  default_max_tokens=self.settings.default_max_tokens,
                                  documents=await self.document_limits(body.get("model")) if documents else self.documents)
        if _REMOTE_URL.search(raw) is None and not documents:  # fetches and page renders: off the loop
            return parse()
        return await asyncio.get_running_loop().run_in_executor(self._media_pool, parse)

    async def document_limits(self, requested: Any) -> DocumentLimits:
        """How the requested model's document pages render: at --document-dpi when given, else at the pixel
        budget of its image processor (common/documents.py), else at the default DPI."""
        if self.settings.document_dpi is not None or not isinstance(requested, str):
            return self.documents
        try:
            model = await self.catalog.resolve(requested)
        except ApiError:  # the 404 comes after the parse, as for a request without documents
            return self.documents
        budget = await self.catalog.page_budget(model)
        return self.documents if budget is None else dataclasses.replace(self.documents, budget=budget)

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes, over the limit max_request_bytes={limit}",
                           code="too_large")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"request body is over the limit max_request_bytes={limit}", code="too_large")
        return bytes(body)

    # -- /v1/chat/completions -----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        self.check_auth(request)
        req = await self.read_chat_request(request)
        model = await self.catalog.resolve(req.model)
        if not self.catalog.is_group(model):
            await self.catalog.tokenizer(model)  # a folder not readable here fails now, not after the cluster's work
        span = tracing.start("POST /v1/chat/completions", request.headers.get("traceparent"), kind="server",
                             attributes={"mserve.stream": req.stream}) if tracing.enabled() else None
        gen = Generation(self, req, model, span)
        self.metrics.started()
        first = await self._next(request, gen)
        if req.stream:
            return StreamingResponse(self._sse(gen, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              MODEL_HEADER: gen.public_model})
        return await self._collect(request, gen, first)

    async def _next(self, request: Request, gen: Generation) -> tuple[str, list[int]] | None:
        """The next piece before the response has started; a failure ends the request (error in
        OpenAI's shape, the cluster's work stopped, counted once)."""
        try:
            return await _unless_disconnected(request, gen.next_delta())
        except BaseException as exc:
            gen.close()
            self._ended(gen, error=exc)
            if isinstance(exc, MServeError):
                raise _api_error(exc) from None
            raise

    async def _collect(self, request: Request, gen: Generation, first: tuple[str, list[int]] | None) -> Response:
        text, ids = [], []
        piece = first
        while piece is not None:
            text.append(piece[0])
            ids.extend(piece[1])
            piece = await self._next(request, gen)
        self._ended(gen)
        usage = usage_of(gen.prompt_tokens, gen.completion_tokens)
        assert gen.finish_reason is not None
        body = chat_response(completion_id(), gen.public_model, "".join(text), gen.finish_reason, usage,
                             gen.detok.ids if gen.req.return_token_ids else None)
        headers = {MODEL_HEADER: gen.public_model}
        if gen.visual_keep_ratio is None:
            return JSONResponse(body, headers=headers)
        body["mserve"] = pruned_marker(gen.visual_keep_ratio)
        return JSONResponse(body, headers={**headers, KEEP_RATIO_HEADER: f"{gen.visual_keep_ratio:g}"})

    async def _sse(self, gen: Generation, first: tuple[str, list[int]] | None) -> AsyncIterator[str]:
        cid, created, model, req = completion_id(), int(time.time()), gen.public_model, gen.req
        with_ids = req.return_token_ids

        def event(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        error: BaseException | None = None
        try:
            yield event(chunk(cid, created, model, {"role": "assistant", "content": ""},
                              include_usage=req.include_usage, token_ids=[] if with_ids else None))
            piece = first
            while piece is not None:
                text, ids = piece
                if text or (with_ids and ids):
                    yield event(chunk(cid, created, model, {"content": text}, include_usage=req.include_usage,
                                      token_ids=ids if with_ids else None))
                piece = await gen.next_delta()
            last = chunk(cid, created, model, {}, gen.finish_reason, include_usage=req.include_usage,
                         token_ids=[] if with_ids else None)
            if gen.visual_keep_ratio is not None:  # headers are gone: the finishing chunk says it
                last["mserve"] = pruned_marker(gen.visual_keep_ratio)
            yield event(last)
            if req.include_usage:
                yield event(chunk(cid, created, model, None, usage=usage_of(gen.prompt_tokens, gen.completion_tokens),
                                  include_usage=True))
            yield "data: [DONE]\n\n"
        except MServeError as exc:  # headers are gone: the error travels as an SSE event, as OpenAI's does
            error = exc
            api = _api_error(exc)
            yield event(api.body())
        except BaseException as exc:  # client gone (cancelled) or a bug: either way stop the cluster's work
            error = exc
            raise
        finally:
            gen.close()
            self._ended(gen, error=error)

    def _ended(self, gen: Generation, error: BaseException | None = None) -> None:
        """A chat completion is over (answered, failed or abandoned): counted, and its span ends."""
        self.metrics.ended(gen, error=error)
        tracing.end(gen.span, attributes={"mserve.finish_reason": gen.finish_reason,
                                          "mserve.completion_tokens": gen.completion_tokens},
                    error=None if error is None else f"{type(error).__name__}: {error}")

    # -- the rest -------------------------------------------------------------------------------------
    async def models(self, request: Request) -> dict[str, Any]:
        self.check_auth(request)
        try:
            await self.catalog.refresh()
        except MServeError as exc:  # the last list stands; /health says the coordinator is away
            log.warning("models: coordinator status unavailable: %s", exc)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "mserve",
                                            **({"mserve_verification": v} if (v := self.catalog.verification(name))
                                               else {}),
                                            **({"mserve_modalities": mod} if (mod := self.catalog.modalities(name))
                                               else {})}
                                           for name in self.catalog.names()]}

    async def health(self) -> Response:
        try:
            status = await self.client.status(timeout_s=2.0)
        except MServeError as exc:
            return JSONResponse({"status": "unavailable", "reason": f"coordinator: {exc.message}"}, status_code=503)
        roles = status.get("roles") or {}
        serving = roles.get("unified", 0) > 0 or (roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0)
        body = {"status": "ok" if serving else "unavailable", "roles": roles,
                "requests_in_flight": status.get("requests_in_flight", 0)}
        if not serving:
            body["reason"] = "no live worker can serve text requests (need unified, or prefill + decode)"
        return JSONResponse(body, status_code=200 if serving else 503)

    async def scrape(self) -> Response:
        try:
            status = await self.client.status(timeout_s=2.0)
        except MServeError as exc:
            log.warning("metrics: coordinator status unavailable: %s", exc)
            status = None
        payload, content_type = self.metrics.render(status)
        return Response(payload, media_type=content_type)


def create_app(settings: GatewaySettings) -> FastAPI:
    gw = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="MServe gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(ClientGone)
    async def _on_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gw.chat(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return await gw.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await gw.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await gw.scrape()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return HTMLResponse(page())

    @app.get("/dashboard/data")
    async def dashboard_data() -> Response:
        try:
            return JSONResponse(await gw.dashboard.data())
        except MServeError as exc:
            return JSONResponse({"error": f"coordinator: {exc.message}"}, status_code=503)

    return app


def serve(settings: GatewaySettings) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                access_log=settings.access_log, timeout_graceful_shutdown=5)
