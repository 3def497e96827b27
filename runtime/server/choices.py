"""The `choices` of an OpenAI response: text, finish reason and, when asked, logprobs in each route's shape.

Chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
Completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}.
Logprobs are the log-softmax of the logits the sampler used (runtime/engine/sampling.py). A token the request's
rules ruled out has logprob -inf, which JSON cannot carry: it is sent as -9999.0, as vLLM does. The token that ended
the completion (end-of-sequence or a stop_token_ids entry) produces no text and is not listed.
"""

from __future__ import annotations

import math

from oval_edge.runtime.engine.request import Request

NO_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NO_LOGPROB


def _listed_samples(request: Request, end_ids: set[int]) -> list:
    samples = request.samples
    if samples and request.finish_reason == "stop" and samples[-1].token in end_ids:
        samples = samples[:-1]
    return samples


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, samples: list) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for sample in samples:
        item = entry(sample.token, sample.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in sample.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, samples: list, text_offset: int = 0) -> dict:
    tokens, logprobs, tops, offsets = [], [], [], []
    for sample in samples:
        text = _piece(tokenizer, sample.token)
        tokens.append(text)
        logprobs.append(_finite(sample.logprob))
        top: dict[str, float] = {}
        for t, lp in sample.top:
            top.setdefault(_piece(tokenizer, t), _finite(lp))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def logprobs_of(kind: str, tokenizer, request: Request, end_ids: set[int], samples: list | None = None,
                text_offset: int = 0) -> dict | None:
    """The choice's logprobs object (None when the request did not ask); `samples` defaults to the whole output."""
    if request.params.logprobs is None:
        return None
    if samples is None:
        samples = _listed_samples(request, end_ids)
    if kind == "chat":
        return chat_logprobs(tokenizer, samples)
    return completion_logprobs(tokenizer, samples, text_offset)


def end_ids(engine, request: Request) -> set[int]:
    return set(engine.eos_ids) | set(request.params.stop_token_ids)


def choice(kind: str, index: int, request: Request, logprobs: dict | None, message: dict | None = None) -> dict:
    if kind == "chat":
        finish = "tool_calls" if message and message.get("tool_calls") else request.finish_reason
        message = message or {"role": "assistant", "content": request.text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": request.text, "logprobs": logprobs, "finish_reason": request.finish_reason}
