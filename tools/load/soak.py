"""A soak against a running `oval-edge serve`: for --minutes, concurrent clients mix streamed answers, streams they
abandon (the server must cancel them), tool calls, json_schema answers and multi-turn chats, while a sampler reads
the server's RSS (/proc/PID/status) and its KV pages (/metrics). The bar: no 5xx, no failed request, every page
free at the end, RSS flat within --rss-tolerance after the warm-up.

    oval-edge serve --chat-template chatml-tools &          # tools need a template that renders them
    python -m oval_edge.tools.load.soak --url http://127.0.0.1:8000 --minutes 20 --json soak.json --plot soak.png

RSS needs the server's process: --pid, or for a loopback URL the process listening on its port (Linux /proc; the
soak runs on the server's machine). Exit status 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from dataclasses import dataclass
from urllib.parse import urlparse

from oval_edge.tools.timing import Stopwatch

from .client import StreamCheck, run_within, stream_chat
from .multiturn import passages
from .report import kv_pages, pages_returned, parse_metrics
from .server import wait_healthy
from .soak_report import WARMUP_FRACTION, format_report, plot, summarize, verdict

# How often each kind is picked; a multi-turn chat is 3 requests, so it is picked less often.
MIX = {"stream": 3, "cancel": 2, "tools": 2, "json_schema": 2, "multiturn": 1}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": {"type": "object", "required": ["city"], "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}},
         {"type": "function", "function": {"name": "convert", "description": "Convert an amount between currencies",
                                           "parameters": {"type": "object", "required": ["amount", "to"],
                                                          "properties": {"amount": {"type": "number"},
                                                                         "to": {"type": "string"}}}}}]
POINT = {"type": "object", "additionalProperties": False, "required": ["name", "x", "y", "weight"],
         "properties": {"name": {"type": "string"}, "x": {"type": "integer"}, "y": {"type": "integer"},
                        "weight": {"type": "number"}}}
# Seconds a request may wait for its next byte, as the openai SDK's default: on a starved machine a tool call (its
# stream sends nothing until the call is whole) took over 120 s, a client's patience and not the server's failure.
READ_TIMEOUT_S = 600.0
SETTLE_S = 15.0  # a cancel frees its pages at the next engine step; give the server a moment at the end


@dataclass
class Outcome:
    kind: str
    at_s: float  # seconds into the soak when it ended
    status: int | None  # HTTP status; None: the connection failed
    result: str  # ok | cancelled | busy (503 + Retry-After) | rejected (4xx) | server_error (other 5xx) | error
    note: str = ""  # what was wrong, or a content remark (a tool call's arguments, a json_schema answer)


def classify(status: int | None, retry_after: str | None) -> str:
    if status is None:
        return "error"
    if status == 503 and retry_after is not None:
        return "busy"
    return "server_error" if status >= 500 else "rejected" if status >= 400 else "ok"


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            line = next(line for line in handle if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def listener_pid(url: str) -> int | None:
    """The process listening on a loopback URL's port (Linux /proc: the socket's inode, then whose fd it is)."""
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                rows = [line.split() for line in handle.readlines()[1:]]
        except OSError:
            continue
        listening = (row for row in rows if row[3] == "0A")  # st 0A: TCP_LISTEN
        inodes |= {f"socket:[{row[9]}]" for row in listening if int(row[1].rsplit(":", 1)[1], 16) == port}
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:  # another user's process, or it exited meanwhile
            continue
    return None


def _json_or_none(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


class Soak:
    """The clients and the sampler of one soak; run() returns the report."""

    def __init__(self, url: str, minutes: float, clients: int, headers: dict, pid: int | None, sample_s: float,
                 seed: int = 0, mix: dict[str, int] | None = None):
        self.url, self.minutes, self.clients, self.headers = url.rstrip("/"), minutes, clients, headers
        self.pid, self.sample_s, self.seed = pid, sample_s, seed
        self.mix = dict(MIX if mix is None else mix)
        unknown = sorted(set(self.mix) - set(MIX))
        if unknown or not self.mix or any(not isinstance(w, int) or w < 1 for w in self.mix.values()):
            raise ValueError(f"mix={self.mix!r}: give kinds of {', '.join(MIX)} with positive integer weights")
        self.outcomes: list[Outcome] = []
        self.samples: list[dict] = []
        self.watch = Stopwatch()

    def _end(self, kind: str, status, result: str, note: str = "") -> Outcome:
        self.outcomes.append(Outcome(kind, round(self.watch.seconds, 2), status, result, note))
        return self.outcomes[-1]

    async def _metrics(self, http) -> dict[str, float]:
        """/metrics as {name: value}; {} when it cannot be read (the sample then records no pages)."""
        import httpx

        try:
            response = await http.get(f"{self.url}/metrics", headers=self.headers)
        except httpx.HTTPError:
            return {}
        return parse_metrics(response.text) if response.status_code == 200 else {}

    async def _sample(self, http) -> None:
        values = await self._metrics(http)
        pages = kv_pages(values)
        self.samples.append({"t_s": round(self.watch.seconds, 2), "requests": len(self.outcomes),
                             "rss_bytes": rss_bytes(self.pid) if self.pid else None,
                             "pages_used": pages["used"], "pages_total": pages["total"],
                             "running": values.get("oval_edge_requests_running"),
                             "waiting": values.get("oval_edge_requests_waiting")})

    async def _sampler(self, http, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._sample(http)
            try:
                await asyncio.wait_for(stop.wait(), self.sample_s)
            except asyncio.TimeoutError:
                pass

    async def _stream(self, http, kind: str, body: dict) -> tuple[Outcome, str]:
        """One streamed request, its events checked (tools/load/client.py); returns its outcome and its text."""
        result = await stream_chat(http, self.url, {**body, "stream": True}, self.headers, 0, 0)
        outcome = classify(result.status, result.retry_after)
        if outcome == "ok" and result.outcome != "completed":  # a 200 whose stream broke
            outcome = "error"
        return self._end(kind, result.status, outcome, result.error or result.problem or ""), result.text

    async def _cancel(self, http, body: dict) -> Outcome:
        """Read the stream's first pieces of content, then close the connection: the server must cancel."""
        async with http.stream("POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True},
                               headers=self.headers) as response:
            kind = classify(response.status_code, response.headers.get("retry-after"))
            if kind != "ok":
                return self._end("cancel", response.status_code, kind, (await response.aread()).decode()[:200])
            check = StreamCheck()
            async for line in response.aiter_lines():
                check.feed(line)
                if check.content_chunks >= 2 or check.done:
                    break
            if check.problem or check.error:
                return self._end("cancel", 200, "error", check.problem or check.error)
            if check.done:  # it ended before it could be abandoned: nothing for the server to cancel
                return self._end("cancel", 200, "ok", "finished before the client left")
        return self._end("cancel", 200, "cancelled")

    async def _tools(self, http, rng: random.Random, body: dict) -> Outcome:
        choice = rng.choice(["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
        body = {**body, "tools": TOOLS, "tool_choice": choice}
        if rng.random() < 0.5:
            return (await self._stream(http, "tools", body))[0]
        response = await http.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
        outcome = self._end("tools", response.status_code, classify(response.status_code,
                                                                     response.headers.get("retry-after")))
        if outcome.result == "ok":
            choice = response.json()["choices"][0]
            calls = choice["message"].get("tool_calls") or []
            valid = all(isinstance(_json_or_none(c["function"]["arguments"]), dict) for c in calls)
            # finish_reason tells a reply under "auto" (stop) from a call cut at max_tokens (length)
            outcome.note = (f"{len(calls)} call(s), arguments {'valid' if valid else 'NOT JSON objects'}, "
                            f"finish {choice['finish_reason']}")
        return outcome

    async def _json_schema(self, http, body: dict) -> Outcome:
        body = {**body, "max_tokens": 96,
                "response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}}
        response = await http.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
        outcome = self._end("json_schema", response.status_code,
                            classify(response.status_code, response.headers.get("retry-after")))
        if outcome.result == "ok":
            parsed = _json_or_none(response.json()["choices"][0]["message"]["content"])
            outcome.note = "parsed" if isinstance(parsed, dict) and set(parsed) == set(POINT["required"]) else \
                "did not parse into the schema's fields"
        return outcome

    async def _multiturn(self, http, rng: random.Random, texts: list[str]) -> None:
        messages = [{"role": "system", "content": "Answer briefly."}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"{rng.choice(texts)}\nWhat happens here?"})
            body = {"messages": list(messages), "max_tokens": rng.randint(16, 48),
                    "stream_options": {"include_usage": True}}
            outcome, text = await self._stream(http, "multiturn", body)
            if outcome.result != "ok":
                return
            messages.append({"role": "assistant", "content": text})

    async def _client(self, client_id: int, http, texts: list[str]) -> None:
        rng = random.Random(self.seed * 1000 + client_id)
        kinds, weights = list(self.mix), list(self.mix.values())
        while self.watch.seconds < self.minutes * 60:
            kind = rng.choices(kinds, weights)[0]
            body = {"messages": [{"role": "user", "content": f"{rng.choice(texts)}\nSum this up in a sentence."}],
                    "max_tokens": rng.randint(16, 96), "temperature": 0.7, "seed": rng.randrange(1 << 30)}
            try:
                if kind == "stream":
                    await self._stream(http, kind, {**body, "stream_options": {"include_usage": True}})
                elif kind == "cancel":
                    await self._cancel(http, {**body, "max_tokens": 400})
                elif kind == "tools":
                    await self._tools(http, rng, {**body, "messages": [{"role": "user", "content": rng.choice(
                        ["What is the weather in Oslo?", "Convert 12.5 euros to yen.", "Is it raining in Lima?"])}]})
                elif kind == "json_schema":
                    await self._json_schema(http, {**body, "messages": [{"role": "user", "content":
                                                                         "Give me a point named A as JSON."}]})
                else:
                    await self._multiturn(http, rng, texts)
            except Exception as exc:  # noqa: BLE001 - a failed request is a finding, and the soak goes on
                self._end(kind, None, "error", f"{type(exc).__name__}: {exc}")

    async def run(self) -> dict:
        import httpx

        texts = passages(64, 60)
        timeout = httpx.Timeout(connect=10.0, read=READ_TIMEOUT_S, write=10.0, pool=READ_TIMEOUT_S)
        # No keep-alive, as the load tool: a server may close an idle connection and httpx does not retry a POST.
        limits = httpx.Limits(max_connections=self.clients + 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            before = await self._metrics(http)
            self.watch = Stopwatch()
            stop = asyncio.Event()
            sampler = asyncio.create_task(self._sampler(http, stop))
            await run_within([self._client(i, http, texts) for i in range(self.clients)], self.minutes * 60 + 300)
            settle = Stopwatch()
            while settle.seconds < SETTLE_S and not pages_returned(kv_pages(await self._metrics(http))):
                await asyncio.sleep(0.25)
            stop.set()
            await sampler
            await self._sample(http)  # the reading the verdict uses: after the settle
            after = await self._metrics(http)
        return self.report(before, after)

    def report(self, before: dict, after: dict) -> dict:
        name = "oval_edge_requests_cancelled_total"
        summary = summarize(self.outcomes, self.samples, self.warmup_s, int(after.get(name, 0) - before.get(name, 0)))
        return {"setup": {"url": self.url, "minutes": self.minutes, "clients": self.clients, "pid": self.pid,
                          "sample_s": self.sample_s, "warmup_s": self.warmup_s, "mix": self.mix},
                "summary": summary, "problems": verdict(summary, set(self.mix), SETTLE_S), "samples": self.samples,
                "requests": [vars(o) for o in self.outcomes]}

    @property
    def warmup_s(self) -> float:
        return self.minutes * 60 * WARMUP_FRACTION


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oval_edge.tools.load.soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the clients keep sending (default 20)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--pid", type=int, help="the server's process id, for its RSS (default: the process listening "
                                                "on a loopback --url's port)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS/page readings (default 10)")
    parser.add_argument("--api-key", default=os.environ.get("OVAL_EDGE_API_KEY"),
                        help="Bearer key, if the server has one (default: $OVAL_EDGE_API_KEY)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the mix each client draws (default 0)")
    parser.add_argument("--mix", default=",".join(f"{k}={w}" for k, w in MIX.items()),
                        help="kinds and their weights, e.g. stream=1 for streams alone (default: %(default)s)")
    parser.add_argument("--json", dest="json_path", help="write the report, every sample and request, here")
    parser.add_argument("--plot", help="write a PNG of RSS and KV pages over time here (needs matplotlib)")
    args = parser.parse_args(argv)
    if not args.minutes > 0 or args.clients < 1 or not args.sample_s > 0:
        parser.error("--minutes and --sample-s must be positive and --clients at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pid = args.pid or listener_pid(args.url)
    try:
        mix = {kind: int(weight) for kind, _, weight in (item.partition("=") for item in args.mix.split(","))}
        soak = Soak(args.url, args.minutes, args.clients, headers, pid, args.sample_s, args.seed, mix)
    except ValueError as exc:
        parser.error(f"--mix {args.mix!r}: {exc}")
    try:
        wait_healthy(soak.url, 10.0, headers)
    except ValueError as exc:
        parser.error(f"{exc.args[0].split('; ')[0]}: start `oval-edge serve` first, or give its --url")
    print(f"soak for {args.minutes:g} min, {args.clients} clients, mix {soak.mix}; server RSS from "
          + (f"pid {pid}" if pid else "nowhere (no --pid, and no local listener found)"), flush=True)
    report = asyncio.run(soak.run())
    print(format_report(report))
    if args.json_path:
        from oval_edge.tools.bench.report import write_json_report

        write_json_report(args.json_path, report)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
