"""Streaming clients for `oval-edge bench --serve`: each sends chat completions with `stream: true` and checks
the Server-Sent Events it gets back, line by line.

A stream is well-formed when every `data:` line holds an OpenAI `chat.completion.chunk` JSON object (or the
final `[DONE]`), the last data line is `data: [DONE]` with nothing after it, and some chunk carries a
finish_reason. Time to first token = request sent -> first chunk with non-empty `delta.content`. Inter-token
latency = the gaps between the arrivals of consecutive such chunks of one request (role-only chunks, the usage
chunk and [DONE] carry no content and are not timed).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from oval_edge.tools.timing import Stopwatch, clock, gaps

SSE_FIELDS = ("event", "id", "retry")  # other SSE fields a server may send; OpenAI streams use only data


@dataclass
class StreamCheck:
    """Feed the response's lines in order; `problem` holds the first thing wrong with the stream."""

    data_lines: int = 0
    content_chunks: int = 0
    done: bool = False
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None  # an error object the server sent inside the stream
    problem: str | None = None
    text: list[str] = field(default_factory=list)

    def feed(self, line: str) -> bool:
        """Check one line (without its newline); True when it carried the first content of the stream."""
        if line == "" or line.startswith(":"):  # event separator / SSE comment (keep-alive)
            return False
        name, _, value = line.partition(":")
        if name != "data":
            if name not in SSE_FIELDS:
                self._fail(f"line {line[:60]!r} is not an SSE field")
            return False
        payload = value[1:] if value.startswith(" ") else value  # SSE strips one space after the colon
        self.data_lines += 1
        if self.done:
            self._fail(f"data after [DONE]: {payload[:60]!r}")
            return False
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self._fail(f"data line {self.data_lines} is not JSON: {payload[:60]!r}")
            return False
        if not isinstance(chunk, dict):
            self._fail(f"data line {self.data_lines} is JSON but not an object")
            return False
        if "error" in chunk:
            err = chunk["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return False
        return self._chunk(chunk)

    def _chunk(self, chunk: dict) -> bool:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if chunk.get("object") != "chat.completion.chunk" or not isinstance(choices, list):
            self._fail(f"data line {self.data_lines} is not a chat.completion.chunk with a choices list")
            return False
        first = False
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                self._fail(f"data line {self.data_lines}: a choice without a delta object")
                return False
            content = delta.get("content")
            if content:
                first = self.content_chunks == 0
                self.content_chunks += 1
                self.text.append(content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return first

    def _fail(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem

    def close(self) -> None:
        """The response ended: a stream without [DONE] or without a finish_reason is cut short."""
        if not self.done:
            self._fail("the stream ended without data: [DONE]")
        elif self.finish_reason is None and self.error is None:
            self._fail("no chunk carried a finish_reason")

    @property
    def well_formed(self) -> bool:
        return self.problem is None


@dataclass
class RequestResult:
    client: int
    index: int
    status: int | None = None  # HTTP status; None when the connection itself failed
    retry_after: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    well_formed: bool | None = None  # None: not a stream (an error status came back instead)
    problem: str | None = None
    error: str | None = None
    prompt_tokens: int = 0  # as the server's usage counted them (0 when it sent none)
    text: str = ""  # the streamed content
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks (s)

    @property
    def outcome(self) -> str:
        """completed | busy (deliberate 503 with Retry-After) | rejected (4xx) | error."""
        if self.status == 200 and self.well_formed and self.error is None:
            return "completed"
        if self.status == 503 and self.retry_after is not None:
            return "busy"
        if self.status is not None and 400 <= self.status < 500:
            return "rejected"
        return "error"


async def stream_chat(client, base_url: str, body: dict, headers: dict, client_id: int, index: int) -> RequestResult:
    """POST one streaming chat completion and check its events; never raises for HTTP or stream failures."""
    import httpx

    result = RequestResult(client_id, index)
    check = StreamCheck()
    arrivals: list[float] = []  # when each chunk with new content text came in
    began = clock()
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            result.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                now, seen = clock(), check.content_chunks
                if check.feed(line) and result.ttft_s is None:
                    result.ttft_s = now - began
                if check.content_chunks > seen:
                    arrivals.append(now)
        check.close()
    except (httpx.HTTPError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        check.close()
    result.latency_s = clock() - began
    result.itl_s = gaps(arrivals)
    result.well_formed = check.well_formed
    result.problem = check.problem
    result.finish_reason = check.finish_reason
    if check.error and result.error is None:
        result.error = f"error in stream: {check.error}"
    usage = check.usage or {}
    result.completion_tokens = int(usage.get("completion_tokens") or check.content_chunks)
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.text = "".join(check.text)
    return result


async def run_within(coroutines: list, time_limit_s: float) -> None:
    """Run the clients concurrently; those still going after `time_limit_s` are cancelled (their requests are then
    missing from the results, and the caller records them as errors)."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    _done, pending = await asyncio.wait(tasks, timeout=time_limit_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def run_clients(base_url: str, model: str, clients: int, requests_per_client: int, max_tokens: int,
                      headers: dict, time_limit_s: float, include_usage: bool = True,
                      transport=None, system_prompt: str | None = None) -> tuple[list[RequestResult], float]:
    """`clients` concurrent clients, each sending its requests one after another. Returns (results, wall s).

    Bounded twice: each request has a read timeout, and the whole run stops at `time_limit_s` (requests still
    open then are recorded as errors). `transport` replaces the network (httpx.ASGITransport in the tests).
    system_prompt: one system message every request starts with (the shared-prefix scenario).
    """
    import httpx

    results: list[RequestResult] = []
    # No keep-alive: a server may close an idle connection between a client's requests (llama-server did: 15 of 128
    # requests failed with "Server disconnected"), and httpx does not retry a POST on a dead connection.
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(connect=10.0, read=max(30.0, time_limit_s), write=10.0, pool=max(30.0, time_limit_s))

    async def one_client(client_id: int, http) -> None:
        for index in range(requests_per_client):
            body = {
                "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Client {client_id}, request {index}: describe a ferry "
                                                          "crossing on a windy morning in a few sentences."}],
            }
            if system_prompt:
                body["messages"].insert(0, {"role": "system", "content": system_prompt})
            if include_usage:
                body["stream_options"] = {"include_usage": True}
            results.append(await stream_chat(http, base_url, body, headers, client_id, index))

    watch = Stopwatch()
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as http:
        await run_within([one_client(i, http) for i in range(clients)], time_limit_s)
    wall = watch.seconds
    seen = {(r.client, r.index) for r in results}
    for client_id in range(clients):  # requests that never finished inside the time limit
        for index in range(requests_per_client):
            if (client_id, index) not in seen:
                results.append(RequestResult(client_id, index, error=f"not finished within --time-limit {time_limit_s:.0f} s"))
    return results, wall
