"""The OpenAI-compatible HTTP app: `create_app(settings, load_engine)` -> a FastAPI app with its own state.

The app answers at once and loads the model in a background thread, so `/health` says 503 "loading" until the
engine is ready (then 200 {"status": "ok"}), and 503 "draining" after SIGTERM. Routes:
GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics, and GET / (the chat
page of webui/, unless `webui` is off).

Model names: a request may omit `model` or name the served model (its id in /v1/models, or "default"); any other
name is 404 `model_not_found`, as OpenAI and vLLM answer, so a client pointed at the wrong server finds out.
"""

# (no `from __future__ import annotations`: FastAPI and pydantic read these annotations at runtime)

import asyncio
import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .engine_loop import EngineLoop
from .errors import (ApiError, ApiKeyGuard, BodyGuard, FastProbes, error_body, install_error_handlers,
                     unknown_field_message)
from .body_params import response_grammar, sampling_params
from .generate import Job, chat_prompt_ids, completion_prompt_ids, respond, stream, submit
from .metrics import ServerMetrics
from .protocol import ignored_fields, request_models
from .tokenize_routes import install_token_routes
from .tool_use.tool_calls import ToolPlan, check_messages, tool_grammar, tool_message, tool_plan, tool_stream
from .webui import install_chat_page

log = logging.getLogger("oval_edge.server")
LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
ERROR_RESPONSES = {code: {"description": text, "content": {"application/json": {"example": error_body(text)}}}
                   for code, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                                      (404, "unknown model"), (413, "body over the size limit"),
                                      (503, "loading, draining or queue full (see Retry-After)"))}


@dataclass(frozen=True)
class ServerSettings:
    """model_name        the id /v1/models lists and responses carry
    api_key           bearer token required on every route but /health (None = open)
    max_body_bytes    larger request bodies get 413
    max_tokens_limit  the largest max_tokens a request may ask for (published in the OpenAPI schema)
    default_max_tokens chat default when max_tokens is omitted (shrunk to fit the token limit);
                      completions default to 16 as in the OpenAI API
    retry_after_s     Retry-After on 503 answers
    strict_requests   refuse (400) body fields no OpenAI request declares, instead of ignoring and naming them
    metrics_public    with an api_key, leave GET /metrics open too (routers and Prometheus scrape without credentials)
    webui             serve the chat page at GET / (open without the key: it holds none, and asks for it)
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 8192
    default_max_tokens: int = 512
    retry_after_s: int = 2
    strict_requests: bool = False
    metrics_public: bool = False
    webui: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name={self.model_name!r} must be a non-empty string")
        if not isinstance(self.strict_requests, bool):
            raise ValueError(f"strict_requests={self.strict_requests!r} must be true or false")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or omitted for an open server)")
        for name in ("metrics_public", "webui"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        for name, low, high in (("max_body_bytes", 1024, 1 << 30), ("max_tokens_limit", 1, 1 << 24),
                                ("default_max_tokens", 1, 1 << 24), ("retry_after_s", 1, 3600)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is out of range: allowed integers in [{low}, {high}]")


class ServerState:
    """Everything one app holds: settings, the engine once loaded, its loop thread and the metrics."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.status = LOADING
        self.engine = None
        self.loop: EngineLoop | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: (self.status, self.engine))
        # Tokenizing and chat templating run here, off the event loop and off the engine thread. One worker: on
        # a 2-core board the engine thread and the event loop already want both cores, and more tokenize
        # threads would only oversubscribe them (requests still overlap: the loop keeps streaming meanwhile).
        # It also keeps two encodes of the one shared tokenizer from ever running at once. Made per serving run
        # in the lifespan (started and shut down with the app).
        self.tokenize_pool: ThreadPoolExecutor | None = None

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenize worker; its exception is raised here."""
        pool = self.tokenize_pool
        if pool is None:  # the app is not running; not reached in practice (nothing is READY then)
            return await asyncio.to_thread(fn, *args)
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
        except RuntimeError as exc:  # the pool is shut down: the app is stopping
            raise ApiError(503, "the server is shutting down and takes no new requests", code="shutting_down",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from exc
        return await future

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests from now on; running ones keep going (EngineLoop.drain ends them)."""
        if self.status == READY:
            self.status = DRAINING

    def require_ready(self, endpoint: str):
        if self.status == READY:
            return self.engine
        self.metrics.observe(endpoint, "unavailable")
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.status == LOADING:
            raise ApiError(503, "the model is still loading; retry shortly (GET /health says 200 when ready)",
                           code="loading", headers=retry)
        if self.status == DRAINING:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="shutting_down",
                           headers=retry)
        raise ApiError(503, f"the model failed to load: {self.load_error}", code="load_failed")

    def check_model(self, name: str | None) -> None:
        if name is None or name in (self.settings.model_name, "default"):
            return
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                       f"{self.settings.model_name!r} (see GET /v1/models)", "model", "model_not_found")


def _load(state: ServerState, load_engine: Callable, on_ready: Callable | None, on_error: Callable | None) -> None:
    try:
        engine = load_engine()
        state.loop = EngineLoop(engine).start()
        state.engine = engine
        state.status = READY
    except Exception as exc:  # noqa: BLE001 - reported on /health and to the command, which exits non-zero
        state.load_error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        state.status = FAILED
        log.error("model load failed: %s", state.load_error)
        if on_error is not None:
            on_error(state.load_error)
        return
    if on_ready is not None:
        on_ready(engine)


def _model_extras(engine) -> dict:
    """/v1/models' extra fields: the context a request may use and the OVAL settings that shape its decode."""
    oval = engine.oval
    return {"max_model_len": engine.token_limit(), "attention": engine.config.attention,
            "oval": {"scorer": oval.scorer, "top_k": oval.top_k, "page_size": oval.page_size,
                     "sink_pages": oval.sink_pages, "window_min": oval.window_min, "window_max": oval.window_max,
                     "dense_layers": oval.dense_layers, "token_budget": oval.token_budget},
            "kv_pages": engine.pool.num_pages}


def create_app(settings: ServerSettings, load_engine: Callable[[], object], on_ready: Callable | None = None,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """load_engine() -> Engine runs in a background thread at startup; on_ready(engine) / on_load_error(message)
    are called from that thread when it is done."""
    state = ServerState(settings)
    ChatCompletionRequest, CompletionRequest = request_models(settings.max_tokens_limit)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oval-edge-tokenize")
        loader = threading.Thread(target=_load, args=(state, load_engine, on_ready, on_load_error),
                                  name="oval-edge-load", daemon=True)
        loader.start()
        try:
            yield
        finally:
            if state.loop is not None:
                state.loop.stop()
            # No waiting: uvicorn has ended the handlers, so a queued encode has nobody left to answer.
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="oval-edge", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a KV page pool with OVAL sparse decode.")
    app.state.server = state
    install_error_handlers(app)
    probes: dict = {}  # path -> handler, filled where the routes are declared below
    app.add_middleware(FastProbes, probes=probes)
    # Each middleware added wraps those before it: the key (outermost) is checked before any body byte is read.
    app.add_middleware(BodyGuard, limit=settings.max_body_bytes)
    if settings.api_key:
        open_paths = ("/health", "/metrics") if settings.metrics_public else ("/health",)
        open_paths += ("/",) if settings.webui else ()
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key, open_paths=open_paths)

    @app.get("/health", summary="200 when ready, 503 while loading or draining")
    async def health() -> Response:
        if state.status == READY:
            return JSONResponse({"status": "ok"})
        body = {"status": state.status}
        if state.load_error:
            body["message"] = state.load_error
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(settings.retry_after_s)})

    probes["/health"] = health

    @app.get("/v1/models", summary="the served model", responses={401: ERROR_RESPONSES[401]})
    async def models() -> dict:
        entry = {"id": settings.model_name, "object": "model", "created": state.created, "owned_by": "oval-edge"}
        if state.engine is not None:
            entry.update(_model_extras(state.engine))
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions", summary="chat completion (stream: true for SSE)", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        job = Job("chat", settings.model_name, include_usage=body.include_usage)
        try:
            engine = state.require_ready(job.endpoint)
            state.check_model(body.model)
            _note_fields(job, body)
            check_messages(body.messages)
            plan = tool_plan(body, engine)  # None: no tools rendered, plain content
            prompt_ids = await chat_prompt_ids(state, engine, body, plan)
            return await _generate(job, prompt_ids, body, http, plan=plan)
        except ApiError as exc:
            _log_refusal(job, exc)
            raise

    @app.post("/v1/completions", summary="text completion (stream: true for SSE)", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        job = Job("completion", settings.model_name, include_usage=body.include_usage)
        try:
            engine = state.require_ready(job.endpoint)
            state.check_model(body.model)
            _note_fields(job, body)
            prompt_ids = await completion_prompt_ids(state, engine, body)
            return await _generate(job, prompt_ids, body, http, default_max_tokens=16)
        except ApiError as exc:
            _log_refusal(job, exc)
            raise

    async def _generate(job: Job, prompt_ids: list[int], body, http: Request, default_max_tokens: int | None = None,
                        plan: ToolPlan | None = None):
        job.prompt_tokens = len(prompt_ids)
        default = min(default_max_tokens or settings.default_max_tokens, settings.max_tokens_limit)
        engine = state.engine
        grammar = await response_grammar(state, engine, body) or await tool_grammar(state, engine, plan)
        params = sampling_params(body, len(prompt_ids), engine.token_limit(), default,
                                 engine.loaded.config.vocab_size, grammar)
        tickets = await submit(state, job, prompt_ids, params, body.n or 1)
        if body.stream:
            return stream(state, job, tickets, (lambda _: tool_stream(plan)) if plan else None)
        return await respond(state, job, tickets, http, (lambda r: tool_message(r, plan)) if plan else None)

    def _note_fields(job: Job, body) -> None:
        """Fields the body carries that this server does not act on go to the X-Ignored-Fields header; with
        strict_requests, one that no OpenAI request declares is a 400 instead."""
        ignored, unknown = ignored_fields(body)
        if unknown and settings.strict_requests:
            raise ApiError(400, unknown_field_message(unknown[0]), unknown[0], "invalid_value")
        job.note_ignored(ignored, unknown)

    def _log_refusal(job: Job, exc: ApiError) -> None:
        if exc.code in ("queue_full",):
            outcome = "busy"
        elif exc.status == 503:
            outcome = "unavailable"
        else:
            outcome = "rejected"
        if outcome != "unavailable":  # require_ready already counted it
            state.metrics.observe(job.endpoint, outcome)
        log.info("%s %s prompt=%d completion=0 ttft=- total=%.3fs outcome=%s(%d): %s", job.id, job.endpoint,
                 job.prompt_tokens, time.perf_counter() - job.arrival, outcome, exc.status, exc.message)

    install_token_routes(app, state, ERROR_RESPONSES)

    @app.get("/metrics", summary="Prometheus metrics", responses={401: ERROR_RESPONSES[401]})
    async def metrics() -> Response:
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    probes["/metrics"] = metrics
    if settings.webui:
        install_chat_page(app)

    return app
