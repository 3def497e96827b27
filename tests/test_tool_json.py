"""The generic tool format (runtime/server/tool_use/tool_json.py) without a model: a reply's JSON string decoded as it grows
(escapes and surrogate pairs split anywhere wait for their end), streamed deltas split anywhere add up to the whole
parse, calls and results of earlier turns rewritten for a template that renders neither, and the instructions
match what the grammar allows."""

from __future__ import annotations

import json
import random

import pytest

from oval_edge.runtime.server.tool_use.tool_json import (REPLY_PREFIX, JsonToolStream, instructions, parse_output,
                                                prompt_messages, reply_text)

NAMES = frozenset({"get_weather", "add"})
REPLY = "Caf\u00e9 \"quoted\"\\ path\nnew line, tab\t, emoji \U0001F600 and \u00e9 \u2603."
CALLS = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                        {"name": "add", "arguments": {"a": 1, "b": 2}}]}
OUTPUTS = [
    REPLY_PREFIX + json.dumps(REPLY)[1:] + "}",  # a whole reply, every escape kind (ensure_ascii: \\u pairs)
    REPLY_PREFIX + json.dumps(REPLY, ensure_ascii=False)[1:-30],  # cut by max_tokens mid-string
    json.dumps(CALLS),
    json.dumps(CALLS)[:-9],  # a call cut by max_tokens: returned as text
    '{"tool_calls": [{"name": "unknown", "arguments": {}}]}',
    '{"res',
]


def _streamed(text: str, rng: random.Random):
    stream, content, calls = JsonToolStream(NAMES, max_calls=2), "", []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 7)
        fields = stream.push(text[pos:pos + step])
        pos += step
        content += (fields or {}).get("content", "")
    last, finish = stream.finish("stop")
    content += (last or {}).get("content", "")
    calls += [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in (last or {}).get("tool_calls",
                                                                                                        ())]
    return content or None, calls, finish


@pytest.mark.parametrize("text", OUTPUTS, ids=range(len(OUTPUTS)))
def test_stream_adds_up_to_the_whole_parse(text):
    content, calls = parse_output(text, NAMES, max_calls=2)
    expected = (content, [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(calls)],
                "tool_calls" if calls else "stop")
    for seed in range(20):
        assert _streamed(text, random.Random(seed)) == expected, seed


def test_parse_shapes():
    assert parse_output(OUTPUTS[0], NAMES, 1) == (REPLY, [])
    assert parse_output(OUTPUTS[1], NAMES, 1)[0] == REPLY[:len(parse_output(OUTPUTS[1], NAMES, 1)[0])]
    content, calls = parse_output(OUTPUTS[2], NAMES, 2)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                                            {"a": 1, "b": 2}]
    assert len(parse_output(OUTPUTS[2], NAMES, 1)[1]) == 1  # max_calls
    assert parse_output(OUTPUTS[3], NAMES, 2) == (OUTPUTS[3], []) and parse_output(OUTPUTS[4], NAMES, 2)[1] == []


def test_reply_text_waits_for_split_escapes():
    whole = json.dumps("a\U0001F600\\b")[1:-1]  # a\ud83d\ude00\\b
    for cut in range(len(whole) + 1):
        decoded, used, closed = reply_text(whole[:cut])
        assert "a\U0001F600\\b".startswith(decoded) and not closed
        assert whole[:used] == json.dumps(decoded)[1:-1]
    assert reply_text(whole + '"}') == ("a\U0001F600\\b", len(whole), True)


def test_history_rewritten_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
        {"role": "tool", "content": "21 C", "tool_call_id": "c2"},
    ]
    out = prompt_messages(messages, "TOOLS")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "Be brief.\n\nTOOLS" and set(out[2]) == {"role", "content"}
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                            {"name": "get_weather", "arguments": {"city": "Rome"}}]}
    results = [json.loads(line)["tool_result"] for line in out[3]["content"].splitlines()]
    assert results == [{"name": "get_weather", "content": "18 C"}, {"name": "get_weather", "content": "21 C"}]
    assert prompt_messages([{"role": "user", "content": "hi"}], "TOOLS")[0] == {"role": "system", "content": "TOOLS"}


def test_instructions_list_every_tool_and_the_allowed_answers():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(NAMES)]
    auto = instructions(tools, [], reply=True, max_calls=1)
    assert all(json.dumps(n) in auto for n in NAMES) and '"response"' in auto and "<" not in auto
    forced = instructions(tools, ["add"], reply=False, max_calls=8)
    assert "the function add" in forced and '"response"' not in forced and "up to 8" in forced
