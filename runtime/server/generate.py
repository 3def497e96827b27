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
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from oval_edge.runtime.engine.request import QueueFull, Request, RequestRejected
from oval_edge.runtime.engine.sampling import SamplingParams

from .choices import choice, end_ids, logprobs_of
from .engine_loop import FINISH, Ticket
from .errors import ApiError, error_response
from .protocol import IGNORED_HEADER

log = logging.getLogger("oval_edge.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.5
MAX_IGNORED_HEADER = 1024


@dataclass
class Job:
    """What the handler knows about one request, for the response body, the log line and the metrics."""

    kind: str  # "chat" or "completion"
    model: str
    arrival: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)  # body fields not acted on (protocol.ignored_fields)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def endpoint(self) -> str:
        return "chat.completions" if self.kind == "chat" else "completions"

    def note_ignored(self, ignored: list[str], unknown: list[str]) -> None:
        """Keep the fields for the response header, and log them at debug level (as vLLM does)."""
        self.ignored = ignored + unknown
        if self.ignored:
            log.debug("%s ignored fields: %s", self.id, ", ".join(
                [f"{name} (not acted on)" for name in ignored] + [f"{name} (unknown)" for name in unknown]))

    def headers(self) -> dict[str, str]:
        """X-Ignored-Fields: the names as JSON string bodies (ASCII, no control characters: a header cannot carry
        them; quoted where empty or with spaces at an end, which a header value cannot end with), the list cut at
        MAX_IGNORED_HEADER characters."""
        if not self.ignored:
            return {}
        value = ", ".join(_header_name(name) for name in self.ignored)
        if len(value) > MAX_IGNORED_HEADER:
            value = value[:MAX_IGNORED_HEADER].rsplit(", ", 1)[0] + ", ..."
        return {IGNORED_HEADER: value}


def _header_name(name: str) -> str:
    escaped = json.dumps(name)[1:-1]
    return escaped if escaped and escaped == escaped.strip() else json.dumps(name)


# ---- prompt ids: the tokenizer and chat template run on the app's tokenize worker, never on the event loop (a
# long conversation's jinja templating would stall every other stream's SSE writes) nor on the engine thread.
async def chat_prompt_ids(state, engine, body, plan=None) -> list[int]:
    """plan: the request's tool_calls.ToolPlan, which says how its tools reach the template (None: no tools)."""
    messages, tools = [m.for_template() for m in body.messages], None
    if plan is not None:
        messages, tools = plan.template_input(messages)
    try:
        return await state.off_loop(engine.encode_chat, messages, *([tools] if tools else []))
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


async def submit(state, job: Job, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[Ticket]:
    """Hand the request's n choices to the engine thread; engine refusals become 400 / 503 with Retry-After.
    Choices after the first wait for its prefill and map its full prompt pages (the prefix cache), so the prompt is
    prefilled once; each has its own generator (seed + index when a seed is given)."""
    tickets: list[Ticket] = []
    try:
        for index in range(n):
            choice_params = params
            if index and params.seed is not None:
                choice_params = dataclasses.replace(params, seed=params.seed + index)
            choice_id = job.id if index == 0 else f"{job.id}-{index}"
            follows = tickets[0].request if tickets else None
            tickets.append(await state.loop.submit(prompt_ids, choice_params, choice_id, follows))
    except RequestRejected as exc:
        _cancel(state, tickets)
        prompt_param = "messages" if job.kind == "chat" else "prompt"
        param = prompt_param if job.prompt_tokens >= state.engine.token_limit() else "max_tokens"
        raise ApiError(400, str(exc), param, "context_length_exceeded") from exc
    except QueueFull as exc:
        _cancel(state, tickets)
        raise ApiError(503, f"the server is busy: {exc}", code="queue_full",
                       headers={"Retry-After": str(state.settings.retry_after_s)}) from exc
    except RuntimeError as exc:
        _cancel(state, tickets)
        raise ApiError(500, f"the engine could not take the request ({exc})") from exc
    except BaseException:
        _cancel(state, tickets)
        raise
    return tickets


def _cancel(state, tickets: list[Ticket]) -> None:
    for ticket in tickets:
        state.loop.cancel(ticket.request_id)
        state.loop.forget(ticket.request_id)


def _ttft(job: Job, request: Request) -> float | None:
    return request.first_token_at - job.arrival if request.first_token_at is not None else None


def finish_log(state, job: Job, request: Request | None, outcome: str) -> None:
    total = time.perf_counter() - job.arrival
    ttft = _ttft(job, request) if request is not None else None
    completion = request.completion_tokens if request is not None else 0
    log.info("%s %s prompt=%d completion=%d ttft=%s total=%.3fs outcome=%s", job.id, job.endpoint, job.prompt_tokens,
             completion, "-" if ttft is None else f"{ttft:.3f}s", total, outcome)
    state.metrics.observe(job.endpoint, outcome, ttft, total if request is not None else None)


def _usage(job: Job, requests: list[Request]) -> dict:
    completion = sum(r.completion_tokens for r in requests)  # the prompt counts once: the choices share it
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


def _server_ended(request: Request, ticket: Ticket) -> str | None:
    """None when the request ended normally (stop/length), else a message saying why the server ended it."""
    if request.finish_reason in ("stop", "length"):
        return None
    if request.finish_reason == "error":
        return f"generation failed: {request.error}"
    return f"generation was cancelled: {ticket.server_note or 'cancelled by the server'}"


async def respond(state, job: Job, tickets: list[Ticket], http: HttpRequest, message=None) -> Response:
    """Wait for every choice (cancelling them if the client leaves) and answer with one JSON object.
    message(request) -> the chat message dict of a choice (tool calls), None for plain content."""
    pending = {t.done for t in tickets}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
        if pending and await http.is_disconnected():
            _cancel(state, tickets)
            finish_log(state, job, tickets[0].request, "disconnected")
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    requests: list[Request] = [t.done.result() for t in tickets]
    for ticket in tickets:
        state.loop.forget(ticket.request_id)
    for request, ticket in zip(requests, tickets):
        problem = _server_ended(request, ticket)
        if problem is not None:
            finish_log(state, job, request, request.finish_reason or "error")
            status = 503 if request.finish_reason == "cancelled" else 500  # logged above: return, do not raise
            return error_response(status, problem, code=request.finish_reason)
    finish_log(state, job, requests[0], requests[0].finish_reason)
    tokenizer = state.engine.tokenizer
    out = []
    for index, request in enumerate(requests):
        logprobs = logprobs_of(job.kind, tokenizer, request, end_ids(state.engine, request))
        out.append(choice(job.kind, index, request, logprobs, message(request) if message else None))
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    return JSONResponse({"id": job.id, "object": obj, "created": job.created, "model": job.model,
                         "choices": out, "usage": _usage(job, requests), "system_fingerprint": None},
                        headers=job.headers())


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk(job: Job, delta: str | None, finish_reason: str | None = None, first: bool = False, index: int = 0,
           logprobs: dict | None = None, delta_fields: dict | None = None) -> dict:
    if job.kind == "chat":
        content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
        content.update(delta_fields or {})
        choice_ = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice_ = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [choice_]}
    if job.include_usage:
        out["usage"] = None  # as OpenAI does: null on every chunk but the last
    return out


async def _merged(tickets: list[Ticket]):
    """(index, kind, payload) from every choice's queue as they come; ends after each choice's FINISH."""
    gets = {asyncio.ensure_future(t.events.get()): i for i, t in enumerate(tickets)}
    try:
        while gets:
            done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = gets.pop(future)
                kind, payload = future.result()
                yield index, kind, payload
                if kind != FINISH:
                    gets[asyncio.ensure_future(tickets[index].events.get())] = index
    finally:
        for future in gets:
            future.cancel()


async def _events(state, job: Job, tickets: list[Ticket], stream_text=None):
    """The SSE body. Cancelled (client gone) at any await: the finally cancels the engine requests.
    stream_text(index) -> a per-choice filter of text deltas into delta fields, with push(text) -> fields or None
    and finish(finish_reason) -> (fields or None, finish_reason) (tool calls); None for plain content."""
    finished: list[Request | None] = [None] * len(tickets)
    listed = [0] * len(tickets)  # samples already sent with logprobs, per choice
    tokenizer = state.engine.tokenizer
    filters = [stream_text(i) if stream_text else None for i in range(len(tickets))]
    problem = None
    try:
        if job.kind == "chat":
            for index in range(len(tickets)):
                yield _sse(_chunk(job, None, first=True, index=index))
        async for index, kind, payload in _merged(tickets):
            request = tickets[index].request
            if kind == FINISH:
                finished[index] = payload
                problem = problem or _server_ended(payload, tickets[index])
                if problem is None:
                    samples = [s for s in payload.samples[listed[index]:]
                               if s.token not in end_ids(state.engine, payload)]
                    logprobs = logprobs_of(job.kind, tokenizer, payload, set(), samples) if samples else None
                    fields, reason = (filters[index].finish(payload.finish_reason) if filters[index]
                                      else (None, payload.finish_reason))
                    yield _sse(_chunk(job, None, reason, index=index, logprobs=logprobs, delta_fields=fields))
                continue
            text, count = payload
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = logprobs_of(job.kind, tokenizer, request, set(), request.samples[listed[index]:count])
                listed[index] = count
            if filters[index] is not None:
                fields = filters[index].push(text)
                if fields is None:
                    continue
                yield _sse(_chunk(job, None, index=index, logprobs=logprobs, delta_fields=fields))
            else:
                yield _sse(_chunk(job, text, index=index, logprobs=logprobs))
        for ticket in tickets:
            state.loop.forget(ticket.request_id)
        if problem is None:
            if job.include_usage:
                yield _sse({"id": job.id, "object": _chunk(job, None)["object"], "created": job.created,
                            "model": job.model, "choices": [], "usage": _usage(job, finished)})
        else:  # as vLLM does: an error object in the stream, then the end marker
            code = next(r.finish_reason for r in finished if r.finish_reason not in ("stop", "length"))
            yield _sse({"error": {"message": problem, "type": "server_error", "param": None, "code": code}})
        yield "data: [DONE]\n\n"
    finally:
        if any(r is None for r in finished):  # the client left (or the server stopped) before the end
            _cancel(state, tickets)
            finish_log(state, job, tickets[0].request, "disconnected")
        else:  # ended in the engine (even if the client left while the last chunks were sent)
            finish_log(state, job, finished[0], finished[0].finish_reason)


def stream(state, job: Job, tickets: list[Ticket], stream_text=None) -> StreamingResponse:
    return StreamingResponse(_events(state, job, tickets, stream_text), media_type="text/event-stream",
                             headers=SSE_HEADERS | job.headers())
