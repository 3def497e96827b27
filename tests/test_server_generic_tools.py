"""Tools with a chat template that does not render them: the bundled SmolLM2 with its own template, served as it
ships (no --chat-template), through the official `openai` client. The generic format (runtime/server/tool_use/tool_json.py)
describes the tools in the system message and decodes the answer under a grammar: a call whose arguments follow
the function's schema (validated here with `jsonschema`) or, for tool_choice auto, a plain reply. Also: named and
none choices, streaming gives what the whole response gives, parallel calls when asked, a round trip through a
tool result, and the fields the body carried that the server does not act on come back in X-Ignored-Fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from schema_cases import function_tools
from test_server_support import make_engine, post, serve_tools_engine, wait_pages_free

from oval_edge.runtime.model.tokenizer import renders_tools

pytestmark = pytest.mark.slow
SEEDS = 10
MAX_TOKENS = 160  # a call to the largest seeded schema takes ~100 tokens
ASK = [{"role": "user", "content": "Use the tool that fits, please."}]
WEATHER = {"type": "function", "function": {
    "name": "weather_now", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def serving():
    engine = make_engine(num_pages=96, max_model_len=1536)
    assert engine.chat_template is None and not renders_tools(engine.tokenizer)  # the model's own template
    yield from serve_tools_engine(engine)


@pytest.fixture(scope="module")
def served(serving):
    return serving[0]


@pytest.fixture(scope="module")
def client(serving):
    return serving[1]


def _required_call(client, seed: int):
    tool = function_tools(6)[seed % 6]
    response = client.chat.completions.create(model="smol-test", messages=ASK, tools=[tool], tool_choice="required",
                                              seed=seed, max_tokens=MAX_TOKENS)
    return tool, response.choices[0]


def test_required_calls_validate_for_every_seed(client):
    with ThreadPoolExecutor(4) as pool:  # the engine batches them (max_batch 4)
        results = list(pool.map(lambda seed: _required_call(client, seed), range(SEEDS)))
    valid = 0
    for tool, choice in results:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == tool["function"]["name"] and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        valid += 1
    print(f"\nrequired tool call, default template: valid arguments {valid}/{SEEDS} seeds")


def test_named_choice_streams_the_same_call(client):
    tools = function_tools(3) + [WEATHER]
    kwargs = dict(model="smol-test", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                  tool_choice={"type": "function", "function": {"name": "weather_now"}}, temperature=0,
                  max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "weather_now" and whole.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "weather_now", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_replies_or_calls_and_none_answers_in_text(client):
    kwargs = dict(model="smol-test", tools=[WEATHER], temperature=0, max_tokens=48)
    # auto: a call or a reply, whichever the model picks, never the format's JSON as content
    replies = []
    for text in ("What is the weather in Paris?", "Say hello to me.", "Hi! How are you?"):
        messages = [{"role": "user", "content": text}]
        choice = client.chat.completions.create(messages=messages, tool_choice="auto", **kwargs).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
            continue
        assert choice.message.content and not choice.message.content.startswith("{"), choice
        replies.append((messages, choice.message.content))
    assert replies, "the model called the tool for every prompt, even a greeting"
    # A reply streamed arrives as content deltas (decoded from the JSON string as it grows) that add up to it.
    messages, content = replies[-1]
    chunks = list(client.chat.completions.create(messages=messages, tool_choice="auto", stream=True, **kwargs))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == content and len(pieces) > 1, pieces
    none = client.chat.completions.create(messages=ASK, tool_choice="none", **kwargs).choices[0]
    assert none.message.tool_calls is None and none.message.content and not none.message.content.startswith("{")


def test_parallel_calls_when_asked(client):
    tools = [WEATHER] + function_tools(2)
    choice = client.chat.completions.create(
        model="smol-test", messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}], tools=tools,
        tool_choice="required", parallel_tool_calls=True, temperature=0, max_tokens=240).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    print(f"\nparallel_tool_calls: {len(choice.message.tool_calls)} call(s)")


def test_round_trip_through_a_tool_result(served, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="smol-test", messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=MAX_TOKENS)
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    raw = client.chat.completions.with_raw_response.create(
        model="smol-test", messages=messages, tools=[WEATHER], temperature=0, max_tokens=32, store=False,
        metadata={"run": "test"}, extra_body={"not_an_openai_field": 1})
    answer = raw.parse().choices[0]
    assert answer.message.content or answer.message.tool_calls
    assert raw.headers["x-ignored-fields"] == "metadata, store, not_an_openai_field"
    wait_pages_free(served.url)


def test_a_tool_schema_the_grammar_cannot_enforce_names_its_tool(served):
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "not": {}}}}
    response = post(served.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, bad],
                                                               "max_tokens": 4}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[1].function.parameters"
