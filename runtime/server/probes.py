"""GET /health and GET /metrics answered in front of FastAPI's routing (plain ASGI middleware).

Why: routers poll both all the time (the llm-d endpoint picker scrapes /metrics every 50 ms; Kubernetes probes
/health), and every request's Python runs on the event loop while holding the GIL the engine thread needs for
its step. FastAPI's path (exception and exit-stack middleware, routing, dependency resolution, the endpoint
wrapper) was about a fifth of a scrape's server CPU (py-spy, docs/fleet.md). The handlers stay FastAPI routes too,
so the OpenAPI schema lists them; this only dispatches to the same functions sooner. It sits inside the API key and
body guards, so /metrics still needs the key unless --metrics-public.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.responses import Response

Probe = Callable[[], Awaitable[Response]]


class FastProbes:
    """Answers GET requests for the paths in `probes` with their handler's Response; passes everything else on."""

    def __init__(self, app, probes: dict[str, Probe]):
        self.app, self.probes = app, probes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET":
            probe = self.probes.get(scope["path"])
            if probe is not None:
                response = await probe()
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
