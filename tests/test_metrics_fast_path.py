"""The scrape path routers poll every 50 ms: GET /health and /metrics are dispatched in front of FastAPI's routing
(FastProbes in runtime/server/errors.py), and the engine's fixed facts are rendered once per engine (runtime/server/metrics.py)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import PlainTextResponse

from oval_edge.runtime.server import metrics as metrics_module
from oval_edge.runtime.server.metrics import ServerMetrics
from oval_edge.runtime.server.errors import FastProbes
from test_server_support import make_engine


def _call(app, method: str, path: str) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return sent


def test_get_probes_are_answered_before_the_app_and_everything_else_reaches_it():
    reached = []

    async def inner(scope, receive, send):
        reached.append((scope["method"], scope["path"]))
        await PlainTextResponse("from the app")(scope, receive, send)

    async def health():
        return PlainTextResponse("ok")

    app = FastProbes(inner, {"/health": health})
    sent = _call(app, "GET", "/health")
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"ok" and reached == []
    for method, path in (("POST", "/health"), ("GET", "/v1/models"), ("HEAD", "/health")):
        assert _call(app, method, path)[1]["body"] == b"from the app"
    assert reached == [("POST", "/health"), ("GET", "/v1/models"), ("HEAD", "/health")]


def test_fixed_facts_render_once_per_engine_and_moving_figures_every_scrape(monkeypatch):
    engine = make_engine(num_pages=24, max_model_len=256)
    rendered = []
    facts = metrics_module._engine_facts
    monkeypatch.setattr(metrics_module, "_engine_facts", lambda e: (rendered.append(e), facts(e))[1])
    metrics = ServerMetrics(lambda: ("ready", engine))
    first = metrics.render()[0].decode()
    metrics.observe("chat", "stop", 0.1, 0.5)
    second = metrics.render()[0].decode()
    assert rendered == [engine]  # the second scrape reused the facts
    families = {f.name: f for f in text_string_to_metric_families(second)}
    assert families["oval_edge_kv_pages_total"].samples[0].value == engine.pool.num_pages
    assert families["oval_edge_kv_pages_free"].samples[0].value == engine.pool.num_free
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info == {"block_size": str(engine.pool.page_size), "num_gpu_blocks": str(engine.pool.num_pages)}
    counted = {s.name: s.value for s in families["oval_edge_http_requests"].samples}
    assert counted == {"oval_edge_http_requests_total": 1.0}
    assert [f.samples for f in text_string_to_metric_families(first) if f.name == "oval_edge_http_requests"] == [[]]
    # every family once: facts and moving figures never share a name
    names = [line.split()[2] for line in second.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
    loading = ServerMetrics(lambda: ("loading", None)).render()[0].decode()
    assert "oval_edge_ready 0.0" in loading and "kv_pages_total" not in loading
