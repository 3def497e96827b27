"""The tool-call parser and its streaming form (runtime/server/tool_use/tool_calls.py) on model outputs in the Hermes /
Qwen2.5 format, and the shipped chatml-tools template: streamed deltas, split anywhere, add up to the same calls and
content as the whole text; text that is no call stays content; the template renders tools, calls and results."""

from __future__ import annotations

import json
import random

import pytest

from oval_edge.runtime.model.tokenizer import SHIPPED_TEMPLATES, parse_template, read_chat_template, renders_tools
from oval_edge.runtime.server.tool_use.tool_calls import ToolPlan, ToolStream, parse_calls

PLAN = ToolPlan(tools=[], names=frozenset({"get_weather", "add"}), forced=(), parallel=True)
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
OUTPUTS = [
    CALL_A,
    "Let me check.\n" + CALL_A + "\n" + CALL_B,
    "no call here, only <tool_ text and a < sign",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> then text',
    '<tool_call>\n{"name": "add", "arguments": {broken json\n</tool_call>',
    CALL_A + '\n<tool_call>\n{"name": "add", "argu',  # cut by max_tokens inside the second call
    "  leading and trailing space  \n",
]


def _streamed(text: str, plan: ToolPlan, rng: random.Random):
    """(content, [(name, arguments)], finish) from ToolStream fed `text` in random pieces."""
    stream, content, calls = ToolStream(plan), "", []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    fields_seen = [stream.push(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    last, finish = stream.finish("stop")
    for fields in [*fields_seen, last]:
        content += (fields or {}).get("content", "")
        for call in (fields or {}).get("tool_calls", []):
            assert call["index"] == len(calls) and call["type"] == "function" and call["id"].startswith("call_")
            calls.append((call["function"]["name"], call["function"]["arguments"]))
    return content, calls, finish


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_adds_up_to_the_whole_parse(text):
    content, calls = parse_calls(text, PLAN)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for seed in range(20):
        got_content, got_calls, finish = _streamed(text, PLAN, random.Random(seed))
        assert got_calls == expected
        assert finish == ("tool_calls" if calls else "stop")
        assert got_content == (content or ""), (seed, got_content, content)


def test_parse_calls_shapes():
    content, calls = parse_calls("Let me check.\n" + CALL_A + "\n" + CALL_B, PLAN)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}  # a JSON string is parsed too
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls(CALL_A, PLAN)[0] is None
    for text in OUTPUTS[2:5]:  # no valid call: the text comes back unchanged
        assert parse_calls(text, PLAN) == (text, [])
    single = ToolPlan(tools=[], names=PLAN.names, forced=(), parallel=False)
    assert len(parse_calls(CALL_A + CALL_B, single)[1]) == 1
    assert len(_streamed(CALL_A + CALL_B, single, random.Random(0))[1]) == 1


def test_shipped_template_renders_tools_calls_and_results():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = read_chat_template("chatml-tools")
    assert set(SHIPPED_TEMPLATES) == {"chatml-tools"} and parse_template(template, "t") is not None
    assert renders_tools(None, template) and not renders_tools(None, "{{ messages[0].content }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True)
    text = rendered[0]
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n4 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    plain, _ = render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=template,
                                     add_generation_prompt=True)
    assert plain[0] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # no tools: plain ChatML


def test_unreadable_template_names_itself(tmp_path):
    with pytest.raises(ValueError, match="chatml-tools"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse"):
        read_chat_template(str(bad))
