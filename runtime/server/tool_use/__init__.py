"""Tool calling over the chat API: which format a request's tools take (tool_calls.py: the Hermes / Qwen2.5
`<tool_call>` format where the chat template renders tools, its parser and streaming form, the grammar that forces
a call) and the generic JSON call-or-reply format for templates that do not (tool_json.py)."""
