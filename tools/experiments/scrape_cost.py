"""What a router's scraper costs decode: decode tok/s with and without GET /metrics every 50 ms (20 Hz).

    python -m oval_edge.tools.experiments.scrape_cost           # starts its own CPU server (the bundled model)
    python -m oval_edge.tools.experiments.scrape_cost --serve http://127.0.0.1:8000 --rounds 8

Rounds alternate (off, on, off, on, ...) so drift on a shared machine hits both sides alike. Each round streams
`--streams` concurrent chats of `--max-tokens` tokens (ignore_eos, so every round decodes the same length); a
request's decode rate is its content chunks after the first over the time they took. Prints the median per side
and their ratio. With --serve auto it also reads the server's own CPU time (/proc/PID/stat) over a stretch of
scraping with no request running: the server's cost per scrape, which other load on the machine does not blur.
The scraper runs on the same machine as the server: on a board the router scrapes from another host. With the
default `--scraper httpx` it is an httpx task in this process, whose own ~1 ms of Python per scrape competes for
the cores too, so that is an upper bound on what the server itself pays; `--scraper socket` scrapes from a child
process with raw kept-alive GETs (socket_scraper.py), costing the machine about what a router's Go or Rust scraper
would, so the difference is what the server pays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from urllib.parse import urlsplit

from ..load.client import stream_chat
from ..load.server import AutoServer
from ..timing import Stopwatch, clock, median, rate
from .socket_scraper import SocketScraper

SCRAPE_PERIOD_S = 0.05
SERVE_ARGS = "--device cpu --max-batch 4 --threads 1"  # one model thread: the 2-core CI machine is shared
PROMPT = "Write a long story about a lighthouse keeper and the sea."


async def _scraper(http, url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET url (a server's /metrics) at a fixed rate (a late scrape shortens the next wait, as Go's ticker would)."""
    next_at = clock()
    while not stop.is_set():
        began = clock()
        response = await http.get(url)
        response.raise_for_status()
        latencies.append(clock() - began)
        next_at += SCRAPE_PERIOD_S
        await asyncio.sleep(max(0.0, next_at - clock()))


class _HttpxScraping:
    """Stretches of 20 Hz scraping by an httpx task in this process (the load generator's own event loop)."""

    def __init__(self, http, url: str, path: str):
        self._http, self._url = http, url + path
        self._task = self._stop = self._latencies = None

    def begin(self) -> None:
        self._stop, self._latencies = asyncio.Event(), []
        self._task = asyncio.create_task(_scraper(self._http, self._url, self._stop, self._latencies))

    async def end(self) -> list[float]:
        self._stop.set()
        await self._task
        return self._latencies


class _SocketScraping:
    """Stretches of 20 Hz scraping by the socket scraper's child process (socket_scraper.py)."""

    def __init__(self, scraper: SocketScraper):
        self._scraper = scraper

    def begin(self) -> None:
        self._scraper.scrape()

    async def end(self) -> list[float]:
        return [seconds for _, seconds in await asyncio.to_thread(self._scraper.pause)]


async def _round(http, url: str, model: str, streams: int, max_tokens: int, scraping=None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    watch = Stopwatch()
    if scraping is not None:
        scraping.begin()
    results = await asyncio.gather(*(stream_chat(http, url, body, {}, i, 0) for i in range(streams)))
    wall = watch.seconds
    latencies = await scraping.end() if scraping is not None else []
    rates = []
    for result in results:
        if result.outcome != "completed" or not result.itl_s:
            raise RuntimeError(f"a request failed: {result.error or result.problem}")
        rates.append(rate(len(result.itl_s), sum(result.itl_s)))
    return {"scrape": scraping is not None, "decode_tok_s_per_stream": rates, "wall_s": wall,
            "scrapes": len(latencies),
            "scrape_latency_ms_p50": 1000 * median(latencies) if latencies else None}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (fields 14, 15)


async def _idle_cpu_cost(scraping, pid: int, seconds: float) -> dict:
    """Server CPU seconds over `seconds` idle, then over `seconds` of 20 Hz scraping; the difference per scrape."""
    start = _cpu_seconds(pid)
    await asyncio.sleep(seconds)
    idle = _cpu_seconds(pid) - start
    start = _cpu_seconds(pid)
    scraping.begin()
    await asyncio.sleep(seconds)
    scrapes = len(await scraping.end())
    scraping_s = _cpu_seconds(pid) - start
    per_scrape_ms = 1000 * (scraping_s - idle) / scrapes
    return {"seconds": seconds, "server_cpu_s_idle": idle, "server_cpu_s_scraping": scraping_s,
            "scrapes": scrapes, "server_cpu_ms_per_scrape": per_scrape_ms,
            "share_of_one_core_at_20hz": per_scrape_ms * 20 / 1000}


async def measure(url: str, rounds: int, streams: int, max_tokens: int, pid: int | None = None,
                  path: str = "/metrics", scraper: str = "httpx") -> dict:
    import httpx

    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(300.0)))
        if scraper == "socket":
            where = urlsplit(url)
            scraping = _SocketScraping(stack.enter_context(SocketScraper(where.hostname, where.port, path)))
        else:
            scraping = _HttpxScraping(http, url, path)
        idle_cost = await _idle_cpu_cost(scraping, pid, 20.0) if pid is not None else None
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        await _round(http, url, model, streams, 8)  # warm-up: first-step costs stay out
        rows = [await _round(http, url, model, streams, max_tokens, scraping if i % 2 else None)
                for i in range(2 * rounds)]
    side = {flag: [r for row in rows if row["scrape"] == flag for r in row["decode_tok_s_per_stream"]]
            for flag in (False, True)}
    off, on = median(side[False]), median(side[True])
    scraped = [row for row in rows if row["scrape"]]
    without = [median(r["decode_tok_s_per_stream"]) for r in rows if not r["scrape"]]
    with_ = [median(r["decode_tok_s_per_stream"]) for r in scraped]
    return {"scrape_path": path, "scraper": scraper, "idle_cpu_cost": idle_cost, "rounds_per_side": rounds,
            "streams": streams, "max_tokens": max_tokens,
            "median_decode_tok_s_per_stream_without": off, "median_decode_tok_s_per_stream_with": on,
            "ratio_with_to_without": on / off, "change_percent": 100.0 * (on - off) / off,
            "round_medians_without": without, "round_medians_with": with_,
            # each scraped round over the unscraped round just before it: drift slower than a round cancels
            "median_pair_ratio": median(w / o for o, w in zip(without, with_)),
            "scrapes_per_round": [row["scrapes"] for row in scraped],
            "scrape_hz": [row["scrapes"] / row["wall_s"] for row in scraped],
            "scrape_latency_ms_p50": median(row["scrape_latency_ms_p50"] for row in scraped),
            "rounds": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oval_edge.tools.experiments.scrape_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--serve", default="auto", help="a server URL, or auto (start `oval-edge serve` here)")
    parser.add_argument("--serve-args", default=SERVE_ARGS,
                        help=f"arguments for the auto server (default: {SERVE_ARGS})")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per side (default 6)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams per round (default 4)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default 96)")
    parser.add_argument("--scrape-path", default="/metrics",
                        help="what the scraper GETs (default /metrics; /health as a control: the HTTP cost alone)")
    parser.add_argument("--scraper", choices=("httpx", "socket"), default="httpx",
                        help="httpx: an httpx client in this process (default); socket: raw kept-alive HTTP/1.1 GETs "
                             "from a child process, as light on the CPU as a router on another host")
    parser.add_argument("--json", dest="json_path", help="write the figures here")
    args = parser.parse_args(argv)
    server = None
    url = args.serve
    if url == "auto":
        server = AutoServer(args.serve_args).start()
        url = server.url
        server.wait_ready(900)
    try:
        pid = server.process.pid if server is not None else None
        report = asyncio.run(measure(url.rstrip("/"), args.rounds, args.streams, args.max_tokens, pid,
                                     args.scrape_path, args.scraper))
    finally:
        if server is not None:
            server.stop()
    print(f"decode tok/s per stream (median over {args.rounds} rounds x {args.streams} streams per side): "
          f"without scraper {report['median_decode_tok_s_per_stream_without']:.2f}, with a 20 Hz {args.scrape_path} "
          f"scraper {report['median_decode_tok_s_per_stream_with']:.2f} (ratio {report['ratio_with_to_without']:.3f}, "
          f"{report['change_percent']:+.1f}%; median of the {args.rounds} paired rounds' ratios "
          f"{report['median_pair_ratio']:.3f}); scrapes per round {report['scrapes_per_round']} "
          f"(median {median(report['scrape_hz']):.1f} Hz), scrape p50 "
          f"{report['scrape_latency_ms_p50']:.1f} ms")
    cost = report["idle_cpu_cost"]
    if cost is not None:
        print(f"server CPU per scrape: {cost['server_cpu_ms_per_scrape']:.2f} ms ({cost['scrapes']} scrapes in "
              f"{cost['seconds']:.0f} s; {100 * cost['share_of_one_core_at_20hz']:.1f}% of one core at 20 Hz)")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
