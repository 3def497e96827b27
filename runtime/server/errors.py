"""OpenAI-style errors for every failure the server answers, and the middleware that runs before any route.

An error body is always `{"error": {"message", "type", "param", "code"}}` and its message says what to change.
The middleware is plain ASGI (not BaseHTTPMiddleware, which would break streaming disconnects): `ApiKeyGuard`
answers 401 before a body is read; `BodyGuard` answers 413 for a body over the limit and 400 for one that is not
UTF-8, then replays the body it read so the route parses it as usual; `FastProbes` answers GET /health and
/metrics before FastAPI's routing.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("oval_edge.server")

INVALID = "invalid_request_error"
TYPE_BY_STATUS = {400: INVALID, 401: "authentication_error", 404: INVALID, 405: INVALID, 413: INVALID,
                  503: "service_unavailable", 500: "internal_error"}
# Bodies over the limit are read and dropped up to this many times the limit (so the client sees the 413 instead
# of a reset mid-upload), then the connection is answered without reading further.
DISCARD_FACTOR = 16
# pydantic's tags for union branches and validators in an error's location; they are not field names.
_MISMATCH = ("_type", "none_required")  # error types that mean "not this JSON type" (endswith)
_LOC_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before")


class ApiError(Exception):
    """Raise from a route: becomes `status` with an OpenAI error object (and optional headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.error_type = error_type or TYPE_BY_STATUS.get(status, INVALID)


def error_body(message: str, error_type: str = INVALID, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, error_type: str | None = None) -> Response:
    # ensure_ascii: an echoed input may hold lone surrogates, which cannot be encoded as UTF-8.
    body = json.dumps(error_body(message, error_type or TYPE_BY_STATUS.get(status, INVALID), param, code))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _param(loc: tuple) -> str | None:
    parts = [p for p in loc[1:] if not (isinstance(p, str) and (p in _LOC_TAGS or "[" in p or "(" in p))]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _shown(value) -> str:
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)
    if isinstance(value, str) and len(value) <= 40:
        return json.dumps(value)
    return ""


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The first pydantic error as (message, param), worded for someone fixing a request by hand."""
    if not errors:
        return "the request body is invalid", None
    # A union field (e.g. stop: string | list) reports one error per branch; the branch whose type matched but
    # whose value broke a bound says most ("at most 8 items" rather than "should be a valid string").
    first = next((e for e in errors if not str(e.get("type", "")).endswith(_MISMATCH)), errors[0])
    kind, loc, ctx = first.get("type", ""), tuple(first.get("loc", ())), first.get("ctx") or {}
    param = _param(loc)
    if kind == "json_invalid":
        where = loc[1] if len(loc) > 1 else "?"
        return f"the body is not valid JSON ({ctx.get('error', 'parse error')} at character {where}); send a JSON " \
               "object", None
    msg = str(first.get("msg", "is invalid"))
    msg = msg[len("Value error, "):] if msg.startswith("Value error, ") else msg
    if param is None and kind != "unknown_field":
        if kind == "missing":
            return "the request body is empty; send a JSON object with Content-Type: application/json", None
        if kind.endswith(_MISMATCH):
            return "the request body must be a JSON object (Content-Type: application/json)", None
        return msg, None
    if kind == "missing":
        return f"'{param}' is required", param
    if kind == "unknown_field":  # a near miss of a real field (protocol.near_miss); loc is the model holding it
        field = f"{param}.{ctx['field']}" if param else ctx["field"]
        return msg.replace(f"'{ctx['field']}'", f"'{field}'", 1), field
    shown = _shown(first.get("input"))
    got = f" (got {shown})" if shown else ""
    return f"{param}: {msg}{got}", param


def unknown_field_message(path: str) -> str:
    return f"unknown field '{path}': this server does not support it; remove it (see /docs)"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, exc.error_type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(list(exc.errors()))
        # The route never ran, so its one log line is written here.
        log.info("- %s %s outcome=rejected(400): %s", request.method, request.url.path, message)
        return error_response(400, message, param, "invalid_value" if param else "invalid_body")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); the server logged the details")


async def _send_error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    response = error_response(status, message, headers=headers)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class ApiKeyGuard:
    """401 unless `Authorization: Bearer <key>`; the open paths (/health) need no key."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.key, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                          "the server was started with (--api-key)", {"WWW-Authenticate": "Bearer"})


class BodyGuard:
    """Reads a request body up front: 413 over `limit` bytes, 400 if it is not UTF-8, else replays it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        too_big = f"the request body is over this server's limit of {self.limit} bytes; send a shorter prompt"
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.limit * DISCARD_FACTOR:
            return await _send_error(send, 413, too_big)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            data = message.get("body", b"")
            size += len(data)
            if size <= self.limit:
                chunks.append(data)
            elif size > self.limit * DISCARD_FACTOR:
                break
            more = message.get("more_body", False)
        if size > self.limit:
            return await _send_error(send, 413, too_big)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return await _send_error(send, 400, f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} "
                                     f"at offset {exc.start}); send JSON encoded as UTF-8")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        await self.app(scope, replay, send)


class FastProbes:
    """Answers GET requests for the paths in `probes` with their handler's Response; passes everything else on.

    Why: routers poll both all the time (the llm-d endpoint picker scrapes /metrics every 50 ms; Kubernetes probes
    /health), and a request's Python runs on the event loop holding the GIL the engine thread needs for its step.
    FastAPI's path (exception and exit-stack middleware, routing, the endpoint wrapper) was about a fifth of a
    scrape's server CPU (py-spy, docs/fleet.md). The handlers stay FastAPI routes too, so the OpenAPI schema lists
    them; this only dispatches to the same functions sooner. It sits inside the guards, so /metrics still needs the
    key unless --metrics-public.
    """

    def __init__(self, app, probes: dict[str, Callable[[], Awaitable[Response]]]):
        self.app, self.probes = app, probes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET":
            probe = self.probes.get(scope["path"])
            if probe is not None:
                response = await probe()
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
