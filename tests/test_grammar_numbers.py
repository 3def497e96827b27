"""JSON numbers are bounded in every grammar the compiler builds (runtime/engine/grammar.py): at most 16 digits
before the point, 16 after it and 2 in an exponent. Checked two ways: the printed grammar repeats no digit without
end, and a matcher over the bundled tokenizer takes a 16-digit integral part but refuses a 17th digit. The generic
tool format's grammar (a call or a reply) is checked here too, since it is built from the same variants."""

from __future__ import annotations

import functools
import json

import pytest
import xgrammar as xgr
from schema_cases import function_tools, schemas

from oval_edge.runtime.engine.grammar import GrammarCompiler, bound_numbers, unbounded_digits

NUMBERS = [
    {"type": "number"},
    {"type": "integer"},
    {"type": "number", "minimum": 0},
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": "number", "maximum": 5},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "number"}},
    {"type": "string", "pattern": "^[0-9]*$"},  # a pattern's digits are the user's: left as they are
    {"type": "string", "format": "date-time"},
]


@functools.cache
def _compiler() -> GrammarCompiler:
    from oval_edge.runtime.model.gguf_metadata import cached_metadata_folder
    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    source = resolve_model("default")
    tokenizer = load_tokenizer(source, cached_metadata_folder(source.path))
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


@pytest.mark.parametrize("schema", NUMBERS + schemas(20), ids=lambda s: json.dumps(s)[:60])
@pytest.mark.parametrize("strict", [True, False])
def test_no_digit_repeats_without_end(schema, strict):
    raw = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict))
    assert unbounded_digits(raw), raw  # xgrammar's own rules do (so the check below can fail)
    bounded = bound_numbers(raw)
    assert unbounded_digits(bounded) == [], bounded
    assert unbounded_digits(str(xgr.Grammar.from_ebnf(bounded))) == []  # xgrammar parses it, bounds kept


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def _takes_prefix(compiled, text: str) -> bool:
    return xgr.GrammarMatcher(compiled).accept_string(text)


def test_compiled_grammars_stop_at_sixteen_digits():
    compiler = _compiler()
    point = compiler.json_schema(NUMBERS[5])
    assert _accepts(point, '{"point": {"x": 1234567890123456.1234567890123456, "y": -5e12}}')
    assert not _takes_prefix(point, '{"point": {"x": 12345678901234567')  # a 17th integral digit
    assert not _takes_prefix(point, '{"point": {"x": 1.12345678901234567')  # a 17th fractional digit
    assert not _takes_prefix(point, '{"point": {"x": 1e123')  # a third exponent digit
    ranged = compiler.json_schema({"type": "integer", "minimum": 0})
    assert _accepts(ranged, "9" * 16) and not _takes_prefix(ranged, "9" * 17)
    anything = compiler.json_object()
    assert _accepts(anything, '{"a": [' + "1" * 16 + "]}") and not _takes_prefix(anything, '{"a": ' + "1" * 17)
    call = compiler.tool_call([("f", NUMBERS[5])], "<c>", "</c>")
    prefix = '<c>{"name": "f", "arguments": {"point": {"x": '
    assert _takes_prefix(call, prefix + "1" * 16) and not _takes_prefix(call, prefix + "1" * 17)


def test_generic_tool_grammar_is_a_call_or_a_reply():
    compiler = _compiler()
    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in function_tools(2)]
    either = compiler.tool_json(tools, max_calls=1, reply=True)
    assert _accepts(either, '{"response": "hello"}')
    assert not _takes_prefix(either, '{"tool_calls": [{"name": "nope"')
    calls_only = compiler.tool_json(tools, max_calls=2, reply=False)
    assert not _takes_prefix(calls_only, '{"response"')
    numbered = compiler.tool_json([("f", {"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]})], max_calls=2, reply=False)
    one = '{"name": "f", "arguments": {"n": 1}}'
    assert _accepts(numbered, '{"tool_calls": [' + one + "]}")
    assert _accepts(numbered, '{"tool_calls": [' + one + ", " + one + "]}")
    assert not _takes_prefix(numbered, '{"tool_calls": [' + ", ".join([one] * 3))  # max_calls
    assert not _takes_prefix(numbered, '{"tool_calls": [{"name": "f", "arguments": {"n": ' + "1" * 17)
