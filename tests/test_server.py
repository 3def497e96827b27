"""The HTTP server with real clients (the official `openai` package and httpx) against a real uvicorn server on a
free loopback port, over the bundled model: chat, completion, streaming, usage, API key, disconnects.

Bad input ([R-bad-input]) lives in test_server_bad_input.py, lifecycle (loading, queue full) in
test_server_lifecycle.py, the fuzzer in test_server_fuzz.py, the real `oval-edge serve` process in
test_server_cli.py.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from test_server_support import ServerThread, assert_error_object, get, make_engine, metrics, post, wait_pages_free

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server():
    engine = make_engine()
    settings = ServerSettings(model_name="smol-test", api_key=KEY, max_tokens_limit=64)
    with ServerThread(create_app(settings, lambda: engine)) as running:
        running.wait_ready()
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_health_models_and_metrics(server):
    assert get(server.url + "/health").json() == {"status": "ok"}  # open without the key
    models = get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["smol-test"]
    assert models["data"][0]["max_model_len"] == 512
    values = metrics(server.url, AUTH)
    assert values["oval_edge_ready"] == 1
    assert values["oval_edge_kv_pages_total"] == 48 and values["oval_edge_kv_page_size_tokens"] == 16
    assert values["oval_edge_token_limit"] == 512
    assert values["oval_edge_prefix_cache_enabled"] == 1 and "oval_edge_prefix_cache_hit_tokens_total" in values
    # a 512-token model scores flat: no coarse group records, and the series are there all the same
    assert values["oval_edge_group_record_slots_used"] == 0 and values["oval_edge_group_records_missing_total"] == 0


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = post(server.url + "/v1/chat/completions", json={"messages": MESSAGES}, headers=headers)
        assert assert_error_object(response, 401)["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error_object(get(server.url + "/metrics"), 401)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openai_chat_completion_and_usage(server, client):
    # Both requests below then map the same cached prompt pages (prefix caching) and compute the same tail: a cold
    # request computes the whole prompt in one chunk instead, whose bf16/nf4 rounding can flip a near-tie (docs).
    client.chat.completions.create(model="smol-test", messages=MESSAGES, max_tokens=1, temperature=0)
    result = client.chat.completions.create(model="smol-test", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = result.choices[0]
    assert result.object == "chat.completion" and result.model == "smol-test" and result.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = server.state.engine.encode_chat(MESSAGES)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= result.usage.completion_tokens <= 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    # The same prompt as token ids on /v1/completions decodes the same greedy text: one engine behind both routes.
    same = client.completions.create(model="smol-test", prompt=prompt_ids, max_tokens=8, temperature=0)
    assert same.choices[0].text == choice.message.content
    values = metrics(server.url, AUTH)  # the last two requests mapped the first one's full prompt pages
    assert values["oval_edge_prefix_cache_hit_tokens_total"] >= 2 * 32
    assert values["oval_edge_kv_pages_free"] == values["oval_edge_kv_pages_total"]  # cached pages count as free
    assert same.usage.prompt_tokens == len(prompt_ids)


def test_openai_streaming_chat_matches_non_streaming(server, client):
    kwargs = dict(model="smol-test", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_openai_completion_stream_and_stop(server, client):
    whole = client.completions.create(model="smol-test", prompt="The capital of France is", max_tokens=10,
                                      temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text
    parts = list(client.completions.create(model="smol-test", prompt="The capital of France is", max_tokens=10,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    # A stop string taken from the greedy output ends the completion before it, with finish_reason "stop".
    words = whole.choices[0].text.split()
    if len(words) >= 2:
        stopped = client.completions.create(model="smol-test", prompt="The capital of France is", max_tokens=10,
                                            temperature=0, stop=[words[1]])
        assert stopped.choices[0].finish_reason == "stop" and words[1] not in stopped.choices[0].text


def _sse_events(response: httpx.Response) -> list[str]:
    """The data fields of an SSE body, checking the framing: every event is `data: ...` then a blank line."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def test_raw_sse_stream_is_well_formed(server):
    body = {"model": "smol-test", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = _sse_events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "smol-test" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_disconnect_mid_stream_frees_pages(server):
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
    before = metrics(server.url, AUTH)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 4:  # role chunk + 3 pieces of text: the request holds pages now
                break
        during = metrics(server.url, AUTH)
        assert during["oval_edge_kv_pages_used"] > 0 and during["oval_edge_requests_running"] == 1
    # Leaving the `with` closed the connection mid-stream.
    after = wait_pages_free(server.url, AUTH)
    assert after["oval_edge_requests_cancelled_total"] == before["oval_edge_requests_cancelled_total"] + 1
    assert after["oval_edge_generation_tokens_total"] < before["oval_edge_generation_tokens_total"] + 60


def test_new_request_joins_a_running_batch(server):
    """Continuous batching: a short request sent while a long stream decodes finishes before that stream does."""
    long_body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True}
    short_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    short_result: dict = {}
    pieces_after_short = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=long_body, headers=AUTH,
                      timeout=120) as response:
        thread = None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if thread is None:
                def send_short():
                    short_result["response"] = post(server.url + "/v1/chat/completions", json=short_body,
                                                          headers=AUTH, timeout=120)
                thread = threading.Thread(target=send_short)
                thread.start()
            elif not thread.is_alive():
                pieces_after_short += 1
    thread.join()
    assert short_result["response"].status_code == 200
    assert pieces_after_short > 0, "the short request waited for the long one instead of joining its batch"
    wait_pages_free(server.url, AUTH)


def test_chat_command_loop_prints_answers(server):
    import io

    from oval_edge.runtime.chat import chat_loop
    from oval_edge.runtime.engine.sampling import SamplingParams

    engine = make_engine(num_pages=16, max_model_len=256, max_batch=1)
    out = io.StringIO()
    assert chat_loop(engine, ["Hello!", "/reset", "Say hi", "/exit", "ignored"], out,
                     SamplingParams(max_tokens=4, temperature=0)) == 0
    first, second = out.getvalue().split("(conversation cleared)\n")
    assert first.strip() and second.strip() and second.endswith("\n")
    assert engine.pool.num_free == engine.pool.num_pages


def test_tokenizing_runs_off_the_event_loop_and_engine_threads(server, client, monkeypatch):
    """Chat templating and text tokenizing run on the app's tokenize worker: not on the event loop's thread (a
    long template would stall every stream's SSE writes), not on the engine thread (it only submits and steps)."""
    import asyncio

    engine = server.state.engine
    seen: list[tuple[str, bool]] = []

    def where() -> None:
        try:
            asyncio.get_running_loop()
            seen.append((threading.current_thread().name, True))
        except RuntimeError:  # no event loop runs in this thread
            seen.append((threading.current_thread().name, False))

    real_encode_chat = engine.encode_chat

    def encode_chat(messages):
        where()
        return real_encode_chat(messages)

    class RecordingTokenizer:  # records where __call__ (encoding) runs; decode etc. pass through untouched
        def __init__(self, real):
            self._real = real

        def __call__(self, *args, **kwargs):
            where()
            return self._real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._real, name)

    monkeypatch.setattr(engine, "encode_chat", encode_chat)
    monkeypatch.setattr(engine, "tokenizer", RecordingTokenizer(engine.tokenizer))
    chat = client.chat.completions.create(model="smol-test", messages=MESSAGES, max_tokens=2, temperature=0)
    text = client.completions.create(model="smol-test", prompt="The capital of France is", max_tokens=2,
                                     temperature=0)
    assert chat.choices[0].message.content and text.choices[0].text
    assert len(seen) == 2, seen
    loop_threads = {server.thread.name, "oval-edge-engine"}
    for name, in_loop in seen:
        assert name.startswith("oval-edge-tokenize") and name not in loop_threads and not in_loop, seen


def test_chat_template_error_is_still_a_400_on_messages(server, monkeypatch):
    import jinja2

    def broken(messages):
        raise jinja2.TemplateError("roles must alternate user/assistant")

    monkeypatch.setattr(server.state.engine, "encode_chat", broken)
    response = post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, headers=AUTH)
    error = assert_error_object(response, 400)
    assert error["param"] == "messages" and "roles must alternate" in error["message"], error
    assert get(server.url + "/health").json() == {"status": "ok"}
