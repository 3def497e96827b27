"""OpenAI fields this server does not act on (store, metadata, service_tier, reasoning_effort, ...), and fields no
OpenAI request declares, are accepted and named in the X-Ignored-Fields header and a debug log line, on both routes,
streamed or not; with strict_requests (serve --strict-requests) an unknown field is a 400 naming it, as before.
Before this, each of them was a 400 'unknown field'. Near misses of real fields are in test_server_bad_input.py."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from test_server_support import ServerThread, assert_error_object, make_engine, post

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
# What the openai SDK, LangChain and agent frameworks send beside the fields that shape the answer.
KNOWN = {"store": True, "metadata": {"run": "7"}, "service_tier": "auto", "reasoning_effort": "low",
         "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "u1", "user": "u1"}
NAMED = "user, metadata, prompt_cache_key, reasoning_effort, safety_identifier, service_tier, store"
MESSAGE = {"role": "user", "content": "Hi", "refusal": None, "client_note": "x"}


def _server(strict: bool) -> ServerThread:
    engine = make_engine(num_pages=16, max_model_len=256)  # here, not in the load thread: one model load at a time
    settings = ServerSettings(model_name="smol-test", max_tokens_limit=8, strict_requests=strict)
    return ServerThread(create_app(settings, lambda: engine))


@pytest.fixture(scope="module")
def servers():
    with _server(False) as lenient, _server(True) as strict:
        lenient.wait_ready()
        strict.wait_ready()
        yield lenient, strict


def _chat(url: str, **fields) -> httpx.Response:
    return post(url + "/v1/chat/completions", json={"messages": [MESSAGE], "max_tokens": 2, **fields}, timeout=120)


def test_fields_not_acted_on_are_named(servers, caplog):
    url = servers[0].url
    with caplog.at_level(logging.DEBUG, logger="oval_edge.server"):
        response = _chat(url, **KNOWN, vendor_flag={"a": 1})
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == f"{NAMED}, vendor_flag, messages[0].client_note"
    logged = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert len(logged) == 1 and "store (not acted on)" in logged[0] and "vendor_flag (unknown)" in logged[0]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True, "store": False,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}) as streamed:
        assert streamed.status_code == 200 and streamed.read().endswith(b"data: [DONE]\n\n")
        assert streamed.headers["x-ignored-fields"] == "stream_options.include_obfuscation, store"
    completion = post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "user": "u", "foo": 1})
    assert completion.status_code == 200 and completion.headers["x-ignored-fields"] == "user, foo"
    plain = _chat(url, messages=[{"role": "user", "content": "Hi"}])
    assert plain.status_code == 200 and "x-ignored-fields" not in plain.headers


def test_names_a_header_cannot_carry_are_escaped(servers):
    response = _chat(servers[0].url, **{"a\nb": 1, "caf\u00e9": 2, "x" * 2000: 3})
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "a\\nb, caf\\u00e9, ...", response.headers["x-ignored-fields"]


def test_wrong_types_of_ignored_fields_are_still_refused(servers):
    for field, value in (("store", "yes"), ("metadata", {"k": 1}), ("service_tier", 3)):
        error = assert_error_object(_chat(servers[0].url, **{field: value}), 400)
        assert error["param"].startswith(field), error


def test_strict_requests_refuse_unknown_fields_only(servers):
    url = servers[1].url
    known = _chat(url, messages=[{"role": "user", "content": "Hi"}], **KNOWN)
    assert known.status_code == 200 and known.headers["x-ignored-fields"] == NAMED
    for fields, param in ((dict(vendor_flag=1, messages=[{"role": "user", "content": "Hi"}]), "vendor_flag"),
                          ({}, "messages[0].client_note")):
        error = assert_error_object(_chat(url, **fields), 400)
        assert error["param"] == param and f"unknown field '{param}'" in error["message"], error
    tool = {"type": "function", "function": {"name": "f", "parameters": {}, "x_vendor": json.dumps(1)}}
    error = assert_error_object(_chat(url, messages=[{"role": "user", "content": "Hi"}], tools=[tool]), 400)
    assert error["param"] == "tools[0].function.x_vendor", error


def test_an_empty_name_or_one_ending_in_a_space_is_quoted(servers):
    """A header value cannot end with a space: schemathesis sent {"\\x8e": .., "": ..} and the server dropped the
    connection ('Illegal header value' in h11) instead of answering."""
    response = _chat(servers[0].url, **{"\x8e": 1, "": 2, "b ": 3})
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"].startswith('\\u008e, "", "b ", '), response.headers["x-ignored-fields"]
