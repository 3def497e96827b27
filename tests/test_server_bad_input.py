"""Bad input gets a clear 4xx with an OpenAI error object and loses nothing ([R-bad-input]): after every case below
the server still answers and /metrics shows every KV page free."""

from __future__ import annotations

import json

import pytest
from test_server_support import ServerThread, assert_error_object, get, make_engine, metrics, post, wait_pages_free

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
BODY_LIMIT = 64 * 1024
OK_MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    engine = make_engine()  # token limit 512
    settings = ServerSettings(model_name="smol-test", max_tokens_limit=64, max_body_bytes=BODY_LIMIT)
    with ServerThread(create_app(settings, lambda: engine)) as running:
        running.wait_ready()
        yield running


def chat(**fields) -> bytes:
    return json.dumps({"messages": OK_MESSAGES, "max_tokens": 2, **fields}).encode()


# (case id, route, raw body, expected status, words the message must contain, expected param)
CASES = [
    ("malformed JSON", "chat", b'{"messages": [', 400, "not valid JSON", None),
    ("body is a list", "chat", b"[1, 2]", 400, "JSON object", None),
    ("empty body", "chat", b"", 400, "empty", None),
    ("messages not a list", "chat", chat(messages="hi"), 400, "messages", "messages"),
    ("max_tokens a string", "chat", chat(max_tokens="10"), 400, "valid integer", "max_tokens"),
    ("temperature a string", "chat", chat(temperature="hot"), 400, "temperature", "temperature"),
    ("stream a string", "chat", chat(stream="yes"), 400, "stream", "stream"),
    ("empty messages", "chat", chat(messages=[]), 400, "at least 1", "messages"),
    ("unknown role", "chat", chat(messages=[{"role": "robot", "content": "x"}]), 400, "role", "messages[0].role"),
    ("content a number", "chat", chat(messages=[{"role": "user", "content": 5}]), 400, "content",
     "messages[0].content"),
    ("max_tokens zero", "chat", chat(max_tokens=0), 400, "greater than or equal to 1", "max_tokens"),
    ("max_tokens negative", "chat", chat(max_tokens=-5), 400, "greater than or equal to 1", "max_tokens"),
    ("max_tokens huge", "chat", chat(max_tokens=10**12), 400, "less than or equal to 64", "max_tokens"),
    ("temperature too high", "chat", chat(temperature=2.5), 400, "less than or equal to 2", "temperature"),
    ("temperature negative", "chat", chat(temperature=-0.1), 400, "greater than or equal to 0", "temperature"),
    ("temperature NaN", "chat", b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     "temperature", "temperature"),
    ("top_p zero", "chat", chat(top_p=0), 400, "greater than 0", "top_p"),
    ("top_p above one", "chat", chat(top_p=1.5), 400, "less than or equal to 1", "top_p"),
    ("n above the bound", "chat", chat(n=9), 400, "less than or equal to 8", "n"),
    ("a real field's name one letter off", "chat", chat(logprob="x"), 400, "did you mean 'logprobs'", "logprob"),
    ("a real field's name in camel case", "chat", chat(maxTokens=2), 400, "did you mean 'max_tokens'", "maxTokens"),
    ("a near miss inside a message", "chat", chat(messages=[{"role": "user", "content": "x", "tool_call": []}]), 400,
     "did you mean 'tool_calls'", "messages[0].tool_call"),
    ("completion: a near miss", "completions", json.dumps({"prompt": "a", "max_token": 2}).encode(), 400,
     "did you mean 'max_tokens'", "max_token"),
    ("an ignored OpenAI field of the wrong type", "chat", chat(store="yes"), 400, "valid boolean", "store"),
    ("logit_bias not a map", "chat", chat(logit_bias="x"), 400, "dictionary", "logit_bias"),
    ("logit_bias out of vocab", "chat", chat(logit_bias={"60000": 1}), 400, "vocabulary", "logit_bias"),
    ("penalty out of range", "chat", chat(presence_penalty=2.5), 400, "less than or equal to 2", "presence_penalty"),
    ("repetition penalty zero", "chat", chat(repetition_penalty=0), 400, "greater than 0", "repetition_penalty"),
    ("top_logprobs without logprobs", "chat", chat(top_logprobs=2), 400, "logprobs: true", "top_logprobs"),
    ("stop token out of vocab", "chat", chat(stop_token_ids=[60000]), 400, "vocabulary", "stop_token_ids"),
    ("schema the grammar cannot compile", "chat",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}), 400,
     'Unsupported type "foo"', "response_format.json_schema.schema"),
    ("schema keyword the grammar ignores", "chat",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}), 400,
     "'not'", "response_format.json_schema.schema"),
    ("json_schema type without a schema", "chat", chat(response_format={"type": "json_schema"}), 400, "json_schema",
     "response_format"),
    ("unknown tool in tool_choice", "chat",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "'g'", "tool_choice"),
    ("tool message without its call id", "chat", chat(messages=[{"role": "tool", "content": "4"}]), 400,
     "tool_call_id", "messages[0].tool_call_id"),
    ("tool_calls on a user message", "chat", chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "assistant",
     "messages[0].tool_calls"),
    ("tool_call_id on a user message", "chat", chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]),
     400, "only tool messages", "messages[0].tool_call_id"),
    ("tool message answering no call", "chat", chat(messages=[*OK_MESSAGES, {"role": "tool", "content": "4",
                                                                             "tool_call_id": "c9"}]), 400,
     "no assistant message", "messages[1].tool_call_id"),
    ("tool_choice required without tools", "chat", chat(tool_choice="required"), 400, "at least one", "tool_choice"),
    ("completion: best_of above one", "completions", json.dumps({"prompt": "a", "best_of": 2}).encode(), 400,
     "not supported", "best_of"),
    ("stream_options without stream", "chat", chat(stream_options={"include_usage": True}), 400, "stream: true",
     None),
    ("too many stop strings", "chat", chat(stop=["a"] * 9), 400, "at most 8", "stop"),
    ("lone surrogate", "chat", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "surrogate",
     "messages[0].content"),
    ("non-UTF-8 body", "chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8", None),
    ("body over the limit", "chat", chat(messages=[{"role": "user", "content": "a" * (2 * BODY_LIMIT)}]), 413,
     str(BODY_LIMIT), None),
    ("prompt over the token limit", "chat", chat(messages=[{"role": "user", "content": "word " * 700}]), 400,
     "limit of 512 tokens", "messages"),
    ("prompt fills the limit, no max_tokens", "chat",
     json.dumps({"messages": [{"role": "user", "content": "word " * 700}]}).encode(), 400, "512 tokens", "messages"),
    ("unknown model", "chat", chat(model="gpt-4o"), 404, "does not exist", "model"),
    ("completion: empty token list", "completions", json.dumps({"prompt": []}).encode(), 400, "prompt", "prompt"),
    ("completion: token id out of vocab", "completions", json.dumps({"prompt": [1, 10**9]}).encode(), 400,
     "vocabulary", "prompt"),
    ("completion: two prompts", "completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "prompt", "prompt"),
    ("completion: empty text", "completions", json.dumps({"prompt": ""}).encode(), 400, "at least 1 character",
     "prompt"),
    ("completion: echo", "completions", json.dumps({"prompt": "a", "echo": True}).encode(), 400, "echo", "echo"),
    ("SGLang extension off its neutral value", "chat", chat(no_stop_trim=True), 400, "should be False",
     "no_stop_trim"),
    ("SGLang reasoning extension off", "chat", chat(separate_reasoning=False), 400, "should be True",
     "separate_reasoning"),
]
# What sglang-router 0.3.2 forwards for {"messages", "max_tokens": 3} (captured from the router): its extensions at
# their defaults, each accepted at that value only.
ROUTER_CHAT = {"messages": OK_MESSAGES, "logprobs": False, "max_completion_tokens": 3, "stream": False,
               "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
ROUTER_COMPLETION = {"prompt": "Hi", "max_tokens": 3, "stream": False, "echo": False, "no_stop_trim": False,
                     "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}


@pytest.mark.parametrize("case_id,route,raw,status,words,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(server, case_id, route, raw, status, words, param):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    error = assert_error_object(response, status)
    assert words in error["message"], error
    assert error["param"] == param, error


def test_wrong_content_type_and_routes(server):
    form = post(server.url + "/v1/chat/completions", data={"messages": "x"})
    assert "JSON object" in assert_error_object(form, 400)["message"]
    assert_error_object(get(server.url + "/v1/nothing"), 404)
    assert_error_object(get(server.url + "/v1/chat/completions"), 405)


def test_server_still_serves_and_no_page_leaked(server):
    """Runs after the bad cases above (file order): the server answers, and no page is held."""
    values = wait_pages_free(server.url)
    assert values["oval_edge_kv_pages_used"] == 0
    ok = post(server.url + "/v1/chat/completions", json={"messages": OK_MESSAGES, "max_tokens": 3,
                                                                "temperature": 0}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    routed = post(server.url + "/v1/chat/completions", json=ROUTER_CHAT, timeout=120)
    assert routed.status_code == 200 and routed.json()["usage"]["completion_tokens"] <= 3, routed.text
    routed = post(server.url + "/v1/completions", json=ROUTER_COMPLETION, timeout=120)
    assert routed.status_code == 200 and routed.json()["choices"][0]["text"], routed.text
    after = wait_pages_free(server.url)
    assert after["oval_edge_requests_refused_total"] >= 1  # the over-limit prompt was refused by the engine
    assert metrics(server.url)["oval_edge_ready"] == 1
