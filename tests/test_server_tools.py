"""Tool calling through the official `openai` client against a served SmolLM2 with the shipped `chatml-tools`
template: a forced call (tool_choice 'required' or a named function) over seeded parameters schemas, each call's
arguments validated with `jsonschema`, then the tool's result sent back as a `tool` message and answered; the same
call streamed as deltas; n choices; and the requests that cannot be served get a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from schema_cases import function_tools
from test_server_support import assert_error_object, make_engine, post, serve_tools_engine, wait_pages_free

from oval_edge.runtime.model.tokenizer import read_chat_template

pytestmark = pytest.mark.slow
TOOL_COUNT = 6
MAX_TOKENS = 160  # a call to the largest seeded schema takes ~100 tokens (wrapper, name, one character a token)
ASK = [{"role": "user", "content": "Use the tool that fits, please."}]


@pytest.fixture(scope="module")
def serving():
    engine = make_engine(num_pages=96, max_model_len=1536)
    engine.chat_template = read_chat_template("chatml-tools")
    yield from serve_tools_engine(engine)


@pytest.fixture(scope="module")
def served(serving):
    return serving[0]


@pytest.fixture(scope="module")
def client(serving):
    return serving[1]


def _case(index: int) -> tuple[list[dict], object, dict]:
    """(tools sent, tool_choice, the tool that must be called): even cases send one tool with 'required', odd
    ones send all of them and name one."""
    tools = function_tools(TOOL_COUNT)
    if index % 2 == 0:
        return [tools[index]], "required", tools[index]
    return tools, {"type": "function", "function": {"name": tools[index]["function"]["name"]}}, tools[index]


def _call(client, tools, choice, stream=False, **extra):
    kwargs = dict(model="smol-test", messages=ASK, tools=tools, tool_choice=choice, temperature=0,
                  max_tokens=MAX_TOKENS, **extra)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        return response.choices[0].message, response.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
            assert delta.type in (None, "function")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    return [calls[i] for i in sorted(calls)], finish


def _round_trip(served, client, index: int) -> tuple[dict, str]:
    tools, choice, wanted = _case(index)
    message, finish = _call(client, tools, choice)
    assert finish == "tool_calls" and message.content is None, (message, finish)
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == wanted["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, wanted["function"]["parameters"])
    result = json.dumps({"ok": True, "case": index})
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = client.chat.completions.create(model="smol-test", messages=history, tools=tools, temperature=0,
                                            max_tokens=24)
    reply = answer.choices[0]
    assert reply.message.role == "assistant" and (reply.message.content or reply.message.tool_calls)
    assert answer.usage.prompt_tokens > 0 and reply.finish_reason in ("stop", "length", "tool_calls")
    # The template rendered the call and its result into the prompt the answer was generated from.
    ids = post(served.url + "/tokenize", json={"messages": history}).json()["tokens"]
    text = post(served.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in text
    return arguments, call.function.name


def test_forced_calls_validate_and_round_trip(served, client):
    with ThreadPoolExecutor(4) as pool:  # the engine batches them (max_batch 4)
        results = list(pool.map(lambda i: _round_trip(served, client, i), range(TOOL_COUNT)))
    print(f"\n{len(results)}/{TOOL_COUNT} forced calls validated; e.g. {results[0][1]}({results[0][0]})")
    wait_pages_free(served.url)


def test_streaming_gives_the_same_call(client):
    for index in (0, 1):
        tools, choice, _ = _case(index)
        _call(client, tools, choice)  # warm-up: both runs below then map the prompt's pages from the prefix cache
        message, finish = _call(client, tools, choice)
        streamed, streamed_finish = _call(client, tools, choice, stream=True)
        assert streamed_finish == finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamed[0]["id"].startswith("call_")


def test_n_choices_each_make_a_valid_call(client):
    tools, choice, wanted = _case(2)
    response = client.chat.completions.create(model="smol-test", messages=ASK, tools=tools, tool_choice=choice,
                                              temperature=1.0, seed=5, n=2, max_tokens=MAX_TOKENS)
    assert [c.index for c in response.choices] == [0, 1]
    for item in response.choices:
        assert item.finish_reason == "tool_calls", item
        jsonschema.validate(json.loads(item.message.tool_calls[0].function.arguments), wanted["function"]["parameters"])


def test_parameters_that_allow_anything_mean_no_arguments(client):
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    response = client.chat.completions.create(model="smol-test", messages=ASK, tools=tools, tool_choice="required",
                                              temperature=0, max_tokens=MAX_TOKENS)
    item = response.choices[0]
    assert item.finish_reason == "tool_calls", item
    assert json.loads(item.message.tool_calls[0].function.arguments) == {}


def test_auto_and_none_answer(client):
    tools, _, _ = _case(1)
    for choice in ("auto", "none"):
        response = client.chat.completions.create(model="smol-test", messages=ASK, tools=tools, tool_choice=choice,
                                                  temperature=0, max_tokens=16)
        item = response.choices[0]
        if choice == "none" or not item.message.tool_calls:  # auto: the model chose; parsed if it wrote a call
            assert item.message.content and item.finish_reason in ("stop", "length")
        else:
            assert item.finish_reason == "tool_calls"


def _chat(url: str, **fields):
    return post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields}, timeout=120)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
BAD = [
    ("logprobs with tools", dict(tools=function_tools(1), logprobs=True), "logprobs", "logprobs"),
    ("parameters the grammar cannot compile", dict(
        tools=function_tools(1) + [{"type": "function", "function": {"name": "g", "parameters": {"type": "foo"}}}],
        tool_choice="required"), 'Unsupported type "foo"', "tools[1].function.parameters"),
    ("parameters keyword the grammar ignores", dict(
        tools=[{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "not": {}}}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), "'not'", "tools[0].function.parameters"),
    ("the same tool name twice", dict(tools=function_tools(1) * 2), "twice", "tools[1].function.name"),
    ("unknown tool in tool_choice", dict(tools=function_tools(1), tool_choice={
        "type": "function", "function": {"name": "nope"}}), "'nope'", "tool_choice"),
    ("tool result for a call never made", dict(messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_2", "content": "x"}]), "call_1", "messages[2].tool_call_id"),
    ("tool message without content", dict(messages=ASK + [
        {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}]), "content",
     "messages[2].content"),
]


@pytest.mark.parametrize("case_id,fields,words,param", BAD, ids=[c[0] for c in BAD])
def test_bad_tool_requests_name_the_field(served, case_id, fields, words, param):
    error = assert_error_object(_chat(served.url, **fields), 400)
    assert words in error["message"] and error["param"] == param, error


def test_nothing_leaked_after_tool_requests(served):
    ok = _chat(served.url, messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
               tools=function_tools(1))
    assert ok.status_code == 200, ok.text
    assert wait_pages_free(served.url)["oval_edge_kv_pages_used"] == 0
