"""Server lifecycle: /health is 503 (JSON) while the model loads and 200 after; a failed load is reported; a full
queue answers 503 with Retry-After; SIGTERM-style draining lets a running stream finish and refuses new work."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from test_server_support import ServerThread, assert_error_object, get, make_engine, metrics, post, wait_pages_free

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}


def test_health_is_503_while_loading_then_200():
    release = threading.Event()
    ready: list = []

    def slow_loader():
        release.wait(60)  # the "model load" cannot finish before the test has looked at /health
        return make_engine(num_pages=8, max_model_len=128)

    app = create_app(ServerSettings(model_name="smol-test"), slow_loader, on_ready=ready.append)
    with ServerThread(app) as server:
        health = get(server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert health.headers["retry-after"] == "2"
        busy = post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert assert_error_object(busy, 503)["code"] == "loading"
        assert busy.headers["retry-after"] == "2"
        assert get(server.url + "/v1/models").json()["data"][0]["id"] == "smol-test"
        assert metrics(server.url)["oval_edge_ready"] == 0
        release.set()
        server.wait_ready(timeout=600)  # the first test to run loads the model here
        assert get(server.url + "/health").json() == {"status": "ok"}
        assert len(ready) == 1 and metrics(server.url)["oval_edge_kv_pages_total"] == 8


def test_failed_load_is_reported_with_its_message():
    errors: list = []

    def broken_loader():
        raise ValueError("model file /models/missing.gguf does not exist")

    app = create_app(ServerSettings(model_name="smol-test"), broken_loader, on_load_error=errors.append)
    with ServerThread(app) as server:
        for _ in range(200):
            if errors:
                break
            threading.Event().wait(0.02)
        health = get(server.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "message": "model file /models/missing.gguf does not exist"}
        refused = post(server.url + "/v1/completions", json={"prompt": "x"})
        assert "/models/missing.gguf" in assert_error_object(refused, 503)["message"]
    assert errors == ["model file /models/missing.gguf does not exist"]


def _first_events(lines, count: int) -> list[str]:
    """Read `count` SSE data fields from an iterator of lines (one iterator per response: httpx streams once)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:])
            if len(out) >= count:
                break
    return out


@pytest.fixture(scope="module")
def one_slot_server():
    engine = make_engine(num_pages=32, max_model_len=512, max_batch=1, max_queue=1)
    settings = ServerSettings(model_name="smol-test", max_tokens_limit=256)
    with ServerThread(create_app(settings, lambda: engine)) as running:
        running.wait_ready()
        yield running


def test_full_queue_gives_503_with_retry_after_and_frees_everything(one_slot_server):
    url = one_slot_server.url + "/v1/chat/completions"
    long = {**CHAT, "max_tokens": 256, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=long, timeout=120) as running:
        running_lines = running.iter_lines()  # keep a reference: a collected iterator closes the response
        _first_events(running_lines, 2)  # decoding: it holds the only batch slot
        with httpx.stream("POST", url, json=long, timeout=120) as queued:
            assert queued.status_code == 200  # accepted into the queue (max_queue=1), waits for the slot
            assert metrics(one_slot_server.url)["oval_edge_requests_waiting"] == 1
            refused = post(url, json={**CHAT, "max_tokens": 2})
            error = assert_error_object(refused, 503)
            assert error["code"] == "queue_full" and refused.headers["retry-after"] == "2"
    values = wait_pages_free(one_slot_server.url)
    assert values["oval_edge_requests_refused_total"] == 1
    assert values['oval_edge_http_requests_total{endpoint=chat.completions,outcome=busy}'] == 1


def test_drain_finishes_running_stream_and_refuses_new_requests(one_slot_server):
    state = one_slot_server.state
    url = one_slot_server.url + "/v1/chat/completions"
    body = {**CHAT, "max_tokens": 12, "ignore_eos": True, "stream": True}
    result: dict = {}
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        lines = response.iter_lines()
        _first_events(lines, 2)
        state.begin_drain()  # what SIGTERM does first (runtime/server/serve.py's DrainingServer)
        drainer = threading.Thread(target=lambda: result.setdefault("cancelled", state.loop.drain(60)))
        drainer.start()
        refused = post(url, json={**CHAT, "max_tokens": 2})
        assert assert_error_object(refused, 503)["code"] == "shutting_down"
        assert get(one_slot_server.url + "/health").json() == {"status": "draining"}
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    drainer.join(60)
    assert result["cancelled"] == 0  # it finished within the grace period
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    wait_pages_free(one_slot_server.url)
