"""The generic tool-call format, for chat templates that do not render tools (the bundled SmolLM2's among them).

The tools are described in the system message, and the model answers with one JSON object, decoded under a
grammar (runtime/engine/grammar.py `tool_json`):

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}    a call (several if asked for)
    {"response": "It is sunny."}                                                  a plain reply (tool_choice auto)

so a call names a listed function and its arguments follow that function's parameters schema, whatever the
model. The conversation's earlier calls and results are rewritten into the same shape (assistant calls as that
JSON, tool results as a user turn), since such a template renders neither `tool_calls` nor the `tool` role.
llama.cpp's server has a fallback of the same idea; the wording and keys here are this server's own.
"""

from __future__ import annotations

import json
import uuid

CALLS_KEY, REPLY_KEY = "tool_calls", "response"
# The grammar's compact separators (any_whitespace off) fix how a reply starts.
REPLY_PREFIX = '{"' + REPLY_KEY + '": "'


def openai_call(data, names: frozenset[str]) -> dict | None:
    """The OpenAI tool call for one parsed {"name", "arguments"} object, or None when it calls none of `names`."""
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def instructions(tools: list[dict], forced: list[str], reply: bool, max_calls: int) -> str:
    """The system text that lists the tools and the answer format. tools: OpenAI's shape; forced: the names
    the answer must call one of ([] for tool_choice auto, where `reply` lets it answer instead)."""
    lines = ["You can call these functions. Each is given as JSON: its name, what it does, and the JSON Schema of "
             "its arguments."]
    for tool in tools:
        function = tool["function"]
        entry = {"name": function["name"], "description": function.get("description", ""),
                 "parameters": function.get("parameters", {})}
        lines.append(json.dumps(entry, ensure_ascii=False))
    # No placeholders such as "<your answer>" in the format's description: a small model copies them verbatim.
    call = ('a JSON object whose key "tool_calls" lists the calls, each an object with the function\'s "name" and '
            'its "arguments" object')
    several = f" (up to {max_calls} calls)" if max_calls > 1 else " (one call)"
    if reply:
        lines.append(f"When a function helps, call it: answer with {call}{several}. Otherwise answer the user with "
                     'a JSON object whose key "response" holds your reply as a string.')
    else:
        which = f"the function {forced[0]}" if len(forced) == 1 else "one of these functions"
        lines.append(f"Call {which}: answer with {call}{several}.")
    return "\n".join(lines)


def prompt_messages(messages: list[dict], system: str) -> list[dict]:
    """`messages` (chat-template dicts) with `system` joined to the system message (or put first) and earlier
    calls and results rewritten: an assistant message's tool_calls become its content as the format's JSON, and
    each run of tool messages becomes one user message of {"tool_result": ...} lines."""
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, from the latest assistant calls
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            names = {c["id"]: c["function"]["name"] for c in message["tool_calls"]}
            out.append({"role": "assistant", "content": json.dumps({CALLS_KEY: calls}, ensure_ascii=False)})
        elif message["role"] == "tool":
            result = json.dumps({"tool_result": {"name": names.get(message["tool_call_id"], ""),
                                                 "content": message["content"]}}, ensure_ascii=False)
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    for message in out:
        message.pop("tool_results", None)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def reply_text(raw: str) -> tuple[str, int, bool]:
    """(the text decoded so far, characters of `raw` it used, whether the string closed) for `raw`, what follows
    REPLY_PREFIX: a JSON string body, maybe cut anywhere. An escape or surrogate pair cut short waits."""
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == '"':
            return json.loads('"' + raw[:i] + '"'), i, True
        if ch == "\\":
            if i + 1 >= len(raw):
                break
            if raw[i + 1] == "u":
                if i + 6 > len(raw):
                    break
                if 0xD800 <= int(raw[i + 2:i + 6], 16) <= 0xDBFF:  # a high surrogate: its low half must follow
                    if i + 12 > len(raw):
                        break
                    i += 6
                i += 6
                continue
            i += 2
            continue
        i += 1
    return json.loads('"' + raw[:i] + '"'), i, False


def parse_output(text: str, names: frozenset[str], max_calls: int) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole completion. A reply is its text (as far as it got); a call list its
    calls; anything else (a call cut by max_tokens) is returned as content, unchanged."""
    if text.startswith(REPLY_PREFIX):
        return reply_text(text[len(REPLY_PREFIX):])[0], []
    try:
        data = json.loads(text)
    except ValueError:
        return text, []
    calls = [openai_call(c, names) for c in data.get(CALLS_KEY, ())] if isinstance(data, dict) else []
    if not calls or None in calls:
        return text, []
    return None, calls[:max_calls]


class JsonToolStream:
    """One choice's SSE filter for the generic format: a reply's text is sent as content deltas while it is
    decoded; a call list is held and sent at the end as `tool_calls` entries (index, id, name, whole arguments),
    with finish_reason 'tool_calls'. Same interface as tool_calls.ToolStream."""

    def __init__(self, names: frozenset[str], max_calls: int):
        self.names, self.max_calls = names, max_calls
        self.text = ""
        self.sent = 0  # reply characters already sent

    def push(self, text: str) -> dict | None:
        self.text += text
        if not self.text.startswith(REPLY_PREFIX):
            return None  # a call, or too little to tell yet
        decoded = reply_text(self.text[len(REPLY_PREFIX):])[0]
        new, self.sent = decoded[self.sent:], len(decoded)
        return {"content": new} if new else None

    def finish(self, finish_reason: str) -> tuple[dict | None, str]:
        content, calls = parse_output(self.text, self.names, self.max_calls)
        if calls:
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, "tool_calls"
        rest = (content or "")[self.sent:] if self.text.startswith(REPLY_PREFIX) else content
        return ({"content": rest} if rest else None), finish_reason
