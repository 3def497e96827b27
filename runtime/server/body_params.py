"""A validated body as the engine's SamplingParams: sampling fields, logit_bias and stop ids checked against the
vocabulary, and response_format (and, for tools, the call's arguments) as a compiled grammar.

Compiling runs on the app's tokenize worker (a schema takes milliseconds, the tokenizer's first scan ~130 ms), never
on the event loop or the engine thread. A schema the grammar cannot enforce is a 400 whose message names the
construct and its JSON path (runtime/engine/grammar.py).
"""

from __future__ import annotations

from oval_edge.runtime.engine.grammar import GrammarError
from oval_edge.runtime.engine.sampling import SamplingParams

from .errors import ApiError


def body_is_chat(body) -> bool:
    return hasattr(body, "messages")


def sampling_params(body, prompt_tokens: int, token_limit: int, default_max_tokens: int, vocab: int,
                    grammar=None) -> SamplingParams:
    """SamplingParams from a validated body; without max_tokens, the default (at most the server's max_tokens
    cap) shrinks to what the token limit leaves after the prompt."""
    max_tokens = body.limit_tokens
    if max_tokens is None:
        room = token_limit - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, and this server's limit is {token_limit} "
                           "tokens for prompt + completion; shorten the prompt",
                           "messages" if body_is_chat(body) else "prompt", "context_length_exceeded")
        max_tokens = min(default_max_tokens, room)
    logprobs = (body.top_logprobs or 0) if body_is_chat(body) and body.logprobs else None
    if not body_is_chat(body):
        logprobs = body.logprobs
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if int(key) >= vocab:
            raise ApiError(400, f"logit_bias: token id {key} is outside the vocabulary (ids 0..{vocab - 1})",
                           "logit_bias", "invalid_value")
        bias[int(key)] = value
    bad = [t for t in body.stop_token_ids or () if t >= vocab]
    if bad:
        raise ApiError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})",
                       "stop_token_ids", "invalid_value")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p), top_k=body.top_k or 0, seed=body.seed,
            stop=body.stop_strings, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            presence_penalty=float(body.presence_penalty or 0.0), frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            min_p=float(body.min_p or 0.0), logit_bias=tuple(bias.items()), logprobs=logprobs, grammar=grammar,
        )
    except ValueError as exc:  # the schema already bounds these; this names the field if the two ever disagree
        raise ApiError(400, str(exc), code="invalid_value") from exc




def _compile_format(engine, response_format):
    if response_format.type == "json_object":
        return engine.grammars().json_object()
    return engine.grammars().json_schema(response_format.json_schema.schema_)


async def response_grammar(state, engine, body):
    """The compiled grammar the body's response_format asks for, or None for free text (after a 400 for fields
    that cannot go together, so nothing is compiled for a request that is refused anyway)."""
    problem = body.field_problems()
    if problem is None and body.ignore_eos and body.response_format is not None and body.response_format.type != "text":
        problem = ("ignore_eos", "ignore_eos cannot be combined with a JSON response_format (the document ends the "
                   "completion); drop one of them")
    if problem is not None:
        raise ApiError(400, problem[1], problem[0], "invalid_value")
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    try:
        return await state.off_loop(_compile_format, engine, response_format)
    except GrammarError as exc:
        param = "response_format.json_schema.schema" if response_format.type == "json_schema" else "response_format"
        raise ApiError(400, f"{param}: {exc}", param, "invalid_schema") from exc
