"""Real client libraries, offline, against a real server of the bundled SmolLM2 with its own chat template (tools go
through the generic format, runtime/server/tool_use/tool_json.py): the `openai` SDK (chat, stream, tools, json_schema),
LangChain's `ChatOpenAI` (invoke, stream, `with_structured_output`, `bind_tools`) and pydantic-ai's `Agent`
completing a tool round trip (call, the tool runs in the agent, its result goes back, a text answer). Each is what
a user would write; nothing here talks HTTP by hand. The versions tested are printed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import version

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_server_support import ServerThread, make_engine, wait_pages_free

from oval_edge.runtime.server.app import ServerSettings, create_app

pytestmark = pytest.mark.slow
MODEL = "smol-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


class Point(BaseModel):
    x: float
    y: float


def get_weather(city: str) -> str:
    """The weather now in a city."""
    return f"18 C and sunny in {city}"


@pytest.fixture(scope="module")
def served():
    engine = make_engine(num_pages=96, max_model_len=1536)
    with ServerThread(create_app(ServerSettings(model_name=MODEL, max_tokens_limit=256), lambda: engine)) as s:
        s.wait_ready()
        print("\nclients: " + ", ".join(f"{name} {version(name)}" for name in (
            "openai", "langchain-openai", "langchain-core", "pydantic-ai-slim")))
        yield s


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=served.url + "/v1", api_key="none", model=MODEL, temperature=0,
                                       max_tokens=48, max_retries=0, timeout=300)


def test_openai_sdk_chat_stream_tools_and_json_schema(client):
    ask = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=24)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    called = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                            tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=64)
    (call,) = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A point, as JSON."}],
                                           response_format=Point, temperature=0, max_tokens=96)
    assert isinstance(parsed.choices[0].message.parsed, Point)


def test_langchain_invoke_and_stream(llm):
    answer = llm.invoke("Name three colours.")
    assert answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    pieces = [chunk.content for chunk in llm.stream("Name three colours.")]
    assert "".join(pieces) == answer.content and len([p for p in pieces if p]) > 1


def test_langchain_structured_output_and_bind_tools(llm):
    for method in ("json_schema", "function_calling"):  # a response_format, then a forced tool call
        point = llm.with_structured_output(Point, method=method).invoke("A point in the plane.", max_tokens=96)
        assert isinstance(point, Point), method
    message = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Rome?",
                                                                           max_tokens=64)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_pydantic_ai_agent_tool_round_trip(served):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    @dataclass
    class CallThenAnswer(AbstractCapability):
        """The agent's own tool_choice per step: call a tool first, then answer from its result (a 135M model left
        to choose would call again and again)."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "none"}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=served.url + "/v1", api_key="none"))
    agent = pydantic_ai.Agent(model, model_settings={"temperature": 0, "max_tokens": 64},
                              capabilities=[CallThenAnswer()])
    cities: list[str] = []

    @agent.tool_plain
    def weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return get_weather(city)

    result = agent.run_sync("What is the weather in Paris?")
    parts = [part for message in result.all_messages() for part in message.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    returns = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert len(calls) == 1 and calls[0].tool_name == "weather" and cities, parts
    assert returns[0].content == get_weather(cities[0]) and returns[0].tool_call_id == calls[0].tool_call_id
    assert isinstance(result.output, str) and result.output
    print(f"\npydantic-ai round trip: weather({cities[0]!r}) -> {result.output[:60]!r}...")
    wait_pages_free(served.url)
