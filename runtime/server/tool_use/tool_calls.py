"""Tool calling on /v1/chat/completions: which format the request's tools take, the grammar that forces a call, and
the model's calls parsed into OpenAI `tool_calls` (whole responses and SSE deltas).

A chat template that renders tools gets the Hermes format below. Any other (the bundled SmolLM2's own) gets the
generic format of tool_json.py: tools in the system message, the answer a JSON call or reply under a grammar, for
every tool_choice, auto included.

The Hermes call format is the Hermes / Qwen2.5 one that the shipped `chatml-tools` template teaches:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, text around it is content.
tool_choice: `none` renders no tools and parses nothing; `auto` renders them and parses whatever calls the model
wrote; `required` and a named function also constrain decoding to exactly one call whose arguments follow the
function's parameters schema (runtime/engine/grammar.py), so they validate unless max_tokens cuts the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from oval_edge.runtime.engine.grammar import ToolSchemaError
from oval_edge.runtime.model.tokenizer import renders_tools

from . import tool_json
from ..errors import ApiError
from ..protocol import NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # generic format with parallel_tool_calls: true (a bound: a small model may list calls on)


@dataclass(frozen=True)
class ToolPlan:
    """tools    the request's tools as the chat template takes them (OpenAI's shape)
    names    the functions a parsed call may name
    forced   indexes into tools the grammar offers (required: all of them; named: that one); () for auto
    parallel whether more than one parsed call is returned (parallel_tool_calls)
    generic  the template does not render tools: the tool_json format, under a grammar for every tool_choice
    max_calls generic format: calls one answer may list (MAX_PARALLEL_CALLS when parallel_tool_calls is true, as
             llama.cpp's server only allows several when asked; else 1)"""

    tools: list[dict]
    names: frozenset[str]
    forced: tuple[int, ...]
    parallel: bool
    generic: bool = False
    max_calls: int = 1

    def template_input(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for the chat template: as they are for a template that renders tools; for the generic
        format, the tools and the answer format described in the system message, and no `tools`."""
        if not self.generic:
            return messages, self.tools
        forced = [self.tools[i]["function"]["name"] for i in self.forced]
        system = tool_json.instructions(self.tools, forced, not self.forced, self.max_calls)
        return tool_json.prompt_messages(messages, system), None


def check_messages(messages) -> None:
    """A 400 naming the field of the first malformed tool or assistant message: tool fields on the wrong role, a
    tool message without content or tool_call_id, or one that answers no call of the assistant message before it."""
    calls: set[str] = set()  # ids of the calls the latest assistant message made
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.tool_calls is not None and message.role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool_calls, not role "
                           f"'{message.role}'", f"{where}.tool_calls", "invalid_value")
        if message.tool_call_id is not None and message.role != "tool":
            raise ApiError(400, f"{where}.tool_call_id: only tool messages carry tool_call_id, not role "
                           f"'{message.role}'", f"{where}.tool_call_id", "invalid_value")
        if message.role == "assistant":
            calls = {call.id for call in message.tool_calls or ()}
        elif message.role == "tool":
            if message.tool_call_id is None:
                raise ApiError(400, f"{where}.tool_call_id: a tool message needs tool_call_id, the id of the "
                               "assistant's tool call it answers", f"{where}.tool_call_id", "missing_required_parameter")
            if message.content is None:
                raise ApiError(400, f"{where}.content: a tool message needs content (the tool's result as text)",
                               f"{where}.content", "missing_required_parameter")
            if message.tool_call_id not in calls:
                known = ", ".join(sorted(calls)) or "none: no assistant message with tool_calls comes before it"
                raise ApiError(400, f"{where}.tool_call_id: '{message.tool_call_id}' answers no tool call of the "
                               f"preceding assistant message (its call ids: {known})", f"{where}.tool_call_id",
                               "invalid_value")


def tool_plan(body, engine) -> ToolPlan | None:
    """What the request's tools ask for, or None when no tools are rendered (none sent, or tool_choice 'none');
    400s for what cannot be served, the body's own field problems first."""
    problem = body.field_problems()
    if problem is not None:
        raise ApiError(400, problem[1], problem[0], "invalid_value")
    if not body.tools or body.tool_choice == "none":
        return None
    for param, on in (("logprobs", body.logprobs), ("ignore_eos", body.ignore_eos)):
        if on:
            raise ApiError(400, f"{param} cannot be combined with tools on this server; drop one of them", param,
                           "invalid_value")
    names = [tool.function.name for tool in body.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(400, f"tools[{i}].function.name: '{name}' is given twice; tool names must be unique",
                           f"tools[{i}].function.name", "invalid_value")
    if isinstance(body.tool_choice, NamedToolChoice):
        forced = (names.index(body.tool_choice.function.name),)
    else:
        forced = tuple(range(len(names))) if body.tool_choice == "required" else ()
    tools = [tool.model_dump(exclude_none=True, by_alias=True, exclude=_extras(tool)) for tool in body.tools]
    generic = not renders_tools(engine.tokenizer, engine.chat_template)
    max_calls = MAX_PARALLEL_CALLS if generic and body.parallel_tool_calls is True else 1
    return ToolPlan(tools, frozenset(names), forced, body.parallel_tool_calls is not False, generic, max_calls)


def _extras(tool) -> dict:
    """model_dump's exclude for the unknown fields a tool carries (they are named in X-Ignored-Fields, not sent to
    the template)."""
    out: dict = {key: True for key in tool.model_extra or ()}
    if tool.function.model_extra:
        out["function"] = {key: True for key in tool.function.model_extra}
    return out


def _compile(engine, functions, plan: ToolPlan):
    if plan.generic:
        return engine.grammars().tool_json(functions, plan.max_calls, reply=not plan.forced)
    return engine.grammars().tool_call(functions, OPEN + "\n", "\n" + CLOSE)


async def tool_grammar(state, engine, plan: ToolPlan | None):
    """The compiled grammar of the plan's answer: Hermes, one call among plan.forced (None when nothing is forced);
    generic, a call among plan.forced or, for auto, a call to any tool or a reply. 400 naming the function whose
    parameters schema cannot be enforced."""
    if plan is None or not (plan.forced or plan.generic):
        return None
    offered = plan.forced or tuple(range(len(plan.tools)))
    # A schema that allows any value (true, {}) is taken as omitted parameters, a function without arguments:
    # forced, its arguments are {} (as any value, they could be a number, or an object whose keys never end).
    functions = [(plan.tools[i]["function"]["name"], _object_schema(plan.tools[i]["function"]["parameters"]))
                 for i in offered]
    try:
        return await state.off_loop(_compile, engine, functions, plan)
    except ToolSchemaError as exc:
        param = f"tools[{offered[exc.index]}].function.parameters"
        raise ApiError(400, f"{param}: {exc}", param, "invalid_schema") from exc


def _object_schema(parameters):
    return {"type": "object", "properties": {}} if parameters is True or parameters == {} else parameters


def _call(inner: str, names: frozenset[str]) -> dict | None:
    """The OpenAI tool call in one block's text, or None when it is not a call to one of `names`."""
    try:
        return tool_json.openai_call(json.loads(inner), names)
    except ValueError:
        return None


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole completion. Without a call the text is the content, unchanged; with calls
    the text around them (stripped) is, or None. A block that is no valid call stays in the content."""
    calls, content, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start)) >= 0:
        call = _call(text[start + len(OPEN):end], plan.names)
        content.append(text[pos:start] if call else text[pos:end + len(CLOSE)])
        calls += [call] if call else []
        pos = end + len(CLOSE)
    if not calls:
        return text, []
    content.append(text[pos:])
    return "".join(content).strip() or None, calls if plan.parallel else calls[:1]


def tool_message(request, plan: ToolPlan) -> dict:
    if plan.generic:
        content, calls = tool_json.parse_output(request.text, plan.names, plan.max_calls)
    else:
        content, calls = parse_calls(request.text, plan)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def tool_stream(plan: ToolPlan):
    """One choice's SSE filter for the plan's format."""
    return tool_json.JsonToolStream(plan.names, plan.max_calls) if plan.generic else ToolStream(plan)


class ToolStream:
    """One choice's SSE filter: text deltas in, delta fields out (content, and each call as one `tool_calls`
    entry with its index, id, name and whole arguments once its block has closed). Text that may begin a call is
    held back; trailing whitespace is held until more text comes, and dropped before a call and after the last
    one, as parse_calls strips it (leading whitespace before a first call is the one difference: it is sent)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buffer = ""
        self.held = ""  # whitespace not sent yet
        self.calls = 0

    def push(self, text: str) -> dict | None:
        self.buffer += text
        content, calls = "", []
        while self.buffer:
            if self.buffer.startswith(OPEN):
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break  # the block is still coming
                block, self.buffer = self.buffer[:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
                call = _call(block[len(OPEN):-len(CLOSE)], self.plan.names)
                if call is not None and (self.plan.parallel or not self.calls + len(calls)):
                    self.held = ""
                    calls.append({"index": self.calls + len(calls), **call})
                elif call is None:
                    content += self._flush(block)
                continue
            start = self.buffer.find(OPEN)
            cut = start if start >= 0 else len(self.buffer) - _open_prefix(self.buffer)
            content += self._flush(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            if start < 0:
                break
        self.calls += len(calls)
        fields = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        return fields or None

    def _flush(self, text: str) -> str:
        """The text to send now: all but its trailing whitespace, which waits for what follows."""
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body

    def finish(self, finish_reason: str) -> tuple[dict | None, str]:
        """The last delta's fields (the rest of the text) and the finish reason ('tool_calls' after a call)."""
        rest = self.buffer.rstrip() if self.calls else self.held + self.buffer
        self.buffer = self.held = ""
        return ({"content": rest} if rest else None), ("tool_calls" if self.calls else finish_reason)


def _open_prefix(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of OPEN (it may grow into a call)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0
