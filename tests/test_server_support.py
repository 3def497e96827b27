"""Shared by the server tests (no tests here): one model load per pytest process, real uvicorn servers on free
loopback ports in background threads, and a Prometheus text reader.

The model is loaded once (functools.cache) and every test server builds its own small Engine over it: a fixed
page pool (num_pages) so the tests know the token limit, and a short local window so decode really selects pages.
"""

from __future__ import annotations

import functools
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from oval_edge import OvalConfig

PAGE_SIZE = 16
# Token budget (1 sink + 1 page) * 16 + 16 = 48 tokens: a chat prompt (~30 tokens) plus a few generated tokens
# already decodes sparsely, so the server tests run the OVAL path, not only the dense fallback.
TEST_OVAL = OvalConfig(page_size=PAGE_SIZE, top_k=1, window_min=16, window_max=16)


@functools.cache
def loaded_model():
    from oval_edge.runtime.model.loader import load_model

    return load_model("default", "nf4", "cpu")


def make_engine(num_pages: int = 48, max_model_len: int = 512, max_batch: int = 4, max_queue: int = 8):
    from oval_edge.runtime.engine.engine import Engine, EngineConfig

    config = EngineConfig(max_batch=max_batch, max_queue=max_queue, num_pages=num_pages, max_model_len=max_model_len,
                          prefill_chunk=256)
    return Engine(loaded_model(), TEST_OVAL, config)


class ServerThread:
    """A real uvicorn server for `app` on 127.0.0.1:<free port>, run in a thread; a context manager."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def wait_ready(self, timeout: float = 600.0, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if get(self.url + "/health", headers=headers).status_code == 200:
                return
            time.sleep(0.05)
        pytest.fail(f"{self.url} did not become ready in {timeout} s")


def serve_tools_engine(engine):
    """A running server of `engine` as the tool tests use it (model name smol-test, 256 tokens a request at most)
    and an openai client of it: yields (server, client)."""
    import openai

    from oval_edge.runtime.server.app import ServerSettings, create_app

    with ServerThread(create_app(ServerSettings(model_name="smol-test", max_tokens_limit=256), lambda: engine)) as s:
        s.wait_ready()
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)


def get(url: str, **kwargs) -> httpx.Response:
    """httpx.get with a timeout that survives a loaded 2-core machine (httpx's default is 5 s)."""
    return httpx.get(url, timeout=kwargs.pop("timeout", 60), **kwargs)


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=kwargs.pop("timeout", 60), **kwargs)


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """{sample name: value} of /metrics (labelled samples keyed as name{k=v,...})."""
    response = get(url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_pages_free(url: str, headers: dict | None = None, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until every KV page is free and nothing runs or waits; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url, headers)
        if (values["oval_edge_kv_pages_free"] == values["oval_edge_kv_pages_total"]
                and values["oval_edge_requests_running"] == 0 and values["oval_edge_requests_waiting"] == 0):
            return values
        if time.monotonic() > deadline:
            pytest.fail(f"pages not all free after {timeout} s: {values}")
        time.sleep(0.05)


def assert_error_object(response: httpx.Response, status: int) -> dict:
    """The response has `status` and an OpenAI error object with a non-empty message; returns the object."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10, error
    assert isinstance(error["type"], str) and error["type"], error
    return error
