"""One generation request from validated body to OpenAI response: prompt ids, sampling, submit, wait or stream.

Prompt ids come from the app's tokenize worker (ServerState.off_loop): tokenizing and chat templating cost
milliseconds per long conversation, and on the event loop they would delay every other stream's next chunk.

Non-streaming requests wait for the engine's finish and poll for a client disconnect meanwhile; streaming
requests send Server-Sent Events in OpenAI's chunk format, one per piece of new text, ending in `data: [DONE]`.
Either way a client that goes away cancels its request, which frees its KV pages before the next engine step.
Every request ends in one log line: id, prompt/completion tokens, time to first token, total time, outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from oval_edge.runtime.engine.request import QueueFull, Request, RequestRejected
from oval_edge.runtime.engine.sampling import SamplingParams

from .engine_loop import FINISH, Ticket
from .errors import ApiError, error_response

log = logging.getLogger("oval_edge.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.5


@dataclass
class Job:
    """What the handler knows about one request, for the response body, the log line and the metrics."""

    kind: str  # "chat" or "completion"
    model: str
    arrival: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    include_usage: bool = False

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def endpoint(self) -> str:
        return "chat.completions" if self.kind == "chat" else "completions"


def sampling_params(body, prompt_tokens: int, token_limit: int, default_max_tokens: int) -> SamplingParams:
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
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p), top_k=body.top_k or 0, seed=body.seed,
            stop=body.stop_strings, ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:  # the schema already bounds these; this names the field if the two ever disagree
        raise ApiError(400, str(exc), code="invalid_value") from exc


def body_is_chat(body) -> bool:
    return hasattr(body, "messages")


# ---- prompt ids: the tokenizer and chat template run on the app's tokenize worker, never on the event loop (a
# long conversation's jinja templating would stall every other stream's SSE writes) nor on the engine thread.
async def chat_prompt_ids(state, engine, body) -> list[int]:
    messages = [m.for_template() for m in body.messages]
    try:
        return await state.off_loop(engine.encode_chat, messages)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is about these messages (jinja raises many)
        raise ApiError(400, f"the model's chat template rejected these messages: {exc}", "messages") from exc


def _encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


async def completion_prompt_ids(state, engine, body) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str):  # a list of exactly one text
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = await state.off_loop(_encode_text, engine.tokenizer, prompt)
    else:  # token ids: a range check, no tokenizer (cheap enough to stay on the loop)
        vocab = engine.loaded.config.vocab_size
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})",
                           "prompt", "invalid_value")
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise ApiError(400, "prompt: the prompt is empty; send at least one token of text", "prompt")
    return prompt_ids


async def submit(state, job: Job, prompt_ids: list[int], params: SamplingParams) -> Ticket:
    """Hand the request to the engine thread; engine refusals become 400 / 503 with Retry-After."""
    try:
        return await state.loop.submit(prompt_ids, params, job.id)
    except RequestRejected as exc:
        prompt_param = "messages" if job.kind == "chat" else "prompt"
        param = prompt_param if job.prompt_tokens >= state.engine.token_limit() else "max_tokens"
        raise ApiError(400, str(exc), param, "context_length_exceeded") from exc
    except QueueFull as exc:
        raise ApiError(503, f"the server is busy: {exc}", code="queue_full",
                       headers={"Retry-After": str(state.settings.retry_after_s)}) from exc
    except RuntimeError as exc:
        raise ApiError(500, f"the engine could not take the request ({exc})") from exc


def _ttft(job: Job, request: Request) -> float | None:
    return request.first_token_at - job.arrival if request.first_token_at is not None else None


def finish_log(state, job: Job, request: Request | None, outcome: str) -> None:
    total = time.perf_counter() - job.arrival
    ttft = _ttft(job, request) if request is not None else None
    completion = request.completion_tokens if request is not None else 0
    log.info("%s %s prompt=%d completion=%d ttft=%s total=%.3fs outcome=%s", job.id, job.endpoint, job.prompt_tokens,
             completion, "-" if ttft is None else f"{ttft:.3f}s", total, outcome)
    state.metrics.observe(job.endpoint, outcome, ttft, total if request is not None else None)


def _usage(job: Job, request: Request) -> dict:
    completion = request.completion_tokens
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


def _server_ended(request: Request, ticket: Ticket) -> str | None:
    """None when the request ended normally (stop/length), else a message saying why the server ended it."""
    if request.finish_reason in ("stop", "length"):
        return None
    if request.finish_reason == "error":
        return f"generation failed: {request.error}"
    return f"generation was cancelled: {ticket.server_note or 'cancelled by the server'}"


async def respond(state, job: Job, ticket: Ticket, http: HttpRequest) -> Response:
    """Wait for the whole completion (cancelling it if the client leaves) and answer with one JSON object."""
    while not ticket.done.done():
        await asyncio.wait({ticket.done}, timeout=DISCONNECT_POLL_S)
        if not ticket.done.done() and await http.is_disconnected():
            state.loop.cancel(job.id)
            finish_log(state, job, ticket.request, "disconnected")
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    request: Request = ticket.done.result()
    state.loop.forget(job.id)
    problem = _server_ended(request, ticket)
    if problem is not None:
        finish_log(state, job, request, request.finish_reason or "error")
        status = 503 if request.finish_reason == "cancelled" else 500  # logged above: return, do not raise
        return error_response(status, problem, code=request.finish_reason)
    finish_log(state, job, request, request.finish_reason)
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": request.text},
                  "logprobs": None, "finish_reason": request.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": request.text, "logprobs": None, "finish_reason": request.finish_reason}
        obj = "text_completion"
    return JSONResponse({"id": job.id, "object": obj, "created": job.created, "model": job.model,
                         "choices": [choice], "usage": _usage(job, request), "system_fingerprint": None})


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk(job: Job, delta: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
    if job.kind == "chat":
        content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
        choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [choice]}
    if job.include_usage:
        out["usage"] = None  # as OpenAI does: null on every chunk but the last
    return out


async def _events(state, job: Job, ticket: Ticket):
    """The SSE body. Cancelled (client gone) at any await: the finally cancels the engine request."""
    request: Request | None = None
    try:
        if job.kind == "chat":
            yield _sse(_chunk(job, None, first=True))
        while True:
            kind, payload = await ticket.events.get()
            if kind == FINISH:
                request = payload
                break
            yield _sse(_chunk(job, payload))
        state.loop.forget(job.id)
        problem = _server_ended(request, ticket)
        if problem is None:
            yield _sse(_chunk(job, None, request.finish_reason))
            if job.include_usage:
                yield _sse({"id": job.id, "object": _chunk(job, None)["object"], "created": job.created,
                            "model": job.model, "choices": [], "usage": _usage(job, request)})
        else:  # as vLLM does: an error object in the stream, then the end marker
            code = request.finish_reason
            yield _sse({"error": {"message": problem, "type": "server_error", "param": None, "code": code}})
        yield "data: [DONE]\n\n"
    finally:
        if request is None:  # the client left (or the server stopped) before the end: free the pages now
            state.loop.cancel(job.id)
            state.loop.forget(job.id)
            finish_log(state, job, ticket.request, "disconnected")
        else:  # ended in the engine (even if the client left while the last chunks were sent)
            finish_log(state, job, request, request.finish_reason)


def stream(state, job: Job, ticket: Ticket) -> StreamingResponse:
    return StreamingResponse(_events(state, job, ticket), media_type="text/event-stream", headers=SSE_HEADERS)
