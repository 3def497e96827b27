"""`oval-edge bench --serve URL|auto`: drive concurrent streaming clients against `oval-edge serve`.

    oval-edge bench --serve auto --clients 32 --requests-per-client 4 --max-tokens 32 --json load.json
    oval-edge bench --serve http://127.0.0.1:8000 --clients 8

Reports p50/p95 time to first token and inter-token latency, aggregate tok/s, deliberate 503s (with Retry-After),
errors (any other 5xx, any 4xx, broken connections), whether every stream was well-formed, and whether /metrics
shows every KV page free again afterwards; exit status 0 only when all of that holds. From this runtime's /metrics
it also reports, over the run, the prefix-cache hit ratio, preemptions and mixed steps ("unknown" elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from urllib.parse import urlparse

from oval_edge.tools.bench.report import write_json_report
from oval_edge.tools.timing import Stopwatch

from .client import run_clients
from .multiturn import format_turns, passages, per_turn, run_multiturn
from .report import (counter_changes, counters, format_summary, kv_pages, pages_returned, parse_metrics, summarize,
                     verdict)
from .server import AutoServer, wait_healthy

PAGES_SETTLE_S = 10.0  # a disconnect frees pages at the next engine step; give the server a moment


def _check(args: argparse.Namespace) -> None:
    for name, low, high in (("clients", 1, 4096), ("requests_per_client", 1, 100_000), ("max_tokens", 1, 1_000_000),
                            ("turns", 1, 1000), ("turn_tokens", 1, 100_000)):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is out of range: allowed integers in [{low}, {high}]")
    if not args.time_limit > 0:
        raise ValueError(f"--time-limit={args.time_limit!r} must be a positive number of seconds")
    if args.serve != "auto":
        parsed = urlparse(args.serve)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--serve={args.serve!r} is not a server URL; give e.g. http://127.0.0.1:8000 or 'auto'")


def run_load(args: argparse.Namespace) -> int:
    _check(args)
    try:
        import httpx  # noqa: F401 - the clients are httpx's async ones
    except ImportError as exc:
        raise ValueError("--serve needs httpx: pip install httpx (or pip install 'oval-edge[test]')") from exc
    api_key = args.api_key or os.environ.get("OVAL_EDGE_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    elapsed = Stopwatch()  # --time-limit bounds the whole run: server start, health wait and load
    server = None
    if args.serve == "auto":
        server = AutoServer(args.serve_args, api_key).start()
        print(f"started {' '.join(server.command[1:])} (log: {server.log_path})")
        waited = server.wait_ready(args.time_limit, headers)
        print(f"server ready after {waited:.1f} s")
        url = server.url
    else:
        url = args.serve.rstrip("/")
        wait_healthy(url, max(1.0, args.time_limit - elapsed.seconds), headers)
    try:
        report = asyncio.run(_drive(url, args, headers, max(1.0, args.time_limit - elapsed.seconds)))
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped with SIGTERM: exit status {code}")
    if server is not None:
        report["server_exit_code"] = server.exit_code
        if server.exit_code != 0:
            report["problems"].append(f"the server exited with status {server.exit_code} after SIGTERM (want 0)")
    for problem in report["problems"]:
        print(f"  FAIL: {problem}")
    if not report["problems"]:
        print("  OK: every request completed or got a deliberate 503, no other 5xx, all streams well-formed, "
              "every KV page free again")
    if args.json_path:
        write_json_report(args.json_path, report)
    return 0 if not report["problems"] else 1


async def _drive(url: str, args: argparse.Namespace, headers: dict, time_left_s: float, transport=None) -> dict:
    """The load itself, between two readings of /metrics. `transport` replaces the network (the tests)."""
    import httpx

    async with httpx.AsyncClient(timeout=30.0, headers=headers, transport=transport) as http:
        model = await _model_id(http, url)
        before = await _pages(http, url)
        counts_before = await _counters(http, url)
    scenario = getattr(args, "scenario", "burst")
    if scenario == "multiturn":
        results, wall = await run_multiturn(url, model, args.clients, args.turns, args.turn_tokens, args.max_tokens,
                                            headers, time_left_s, transport=transport)
    else:  # burst, or shared-prefix: the same, every request opening with one long system prompt
        system = " ".join(passages(1, args.turn_tokens)) if scenario == "shared-prefix" else None
        results, wall = await run_clients(url, model, args.clients, args.requests_per_client, args.max_tokens,
                                          headers, time_left_s, system_prompt=system, transport=transport)
    async with httpx.AsyncClient(timeout=30.0, headers=headers, transport=transport) as http:
        after, ok = await _settled_pages(http, url, before)
        counts_after = await _counters(http, url)
    summary = summarize(results, wall)
    summary.update(counter_changes(counts_before, counts_after))
    setup = {"url": url, "model": model, "scenario": scenario, "clients": args.clients,
             "requests_per_client": args.turns if scenario == "multiturn" else args.requests_per_client,
             "max_tokens": args.max_tokens, "time_limit_s": args.time_limit}
    print(format_summary(summary, after, ok, setup))
    turns = per_turn(results, args.turns) if scenario == "multiturn" else None
    if turns:
        print(format_turns(turns))
    return {"setup": setup, "summary": summary, "turns": turns, "pages_before": before, "pages_after": after,
            "pages_returned": ok, "problems": verdict(summary, ok),
            "requests": [_request_row(r) for r in results]}


def _request_row(result) -> dict:
    """One request in the JSON: its fields, less the per-chunk gaps (the summary has their percentiles)."""
    row = {k: v for k, v in vars(result).items() if k != "itl_s"}
    return row | {"outcome": result.outcome, "itl_samples": len(result.itl_s)}


async def _model_id(http, url: str) -> str:
    """The first model the server lists (what `model` the requests name); 'default' when it lists none."""
    import httpx

    try:
        response = await http.get(f"{url}/v1/models")
        data = response.json().get("data") or []
        return str(data[0]["id"]) if data else "default"
    except (ValueError, KeyError, TypeError, AttributeError, httpx.HTTPError):
        return "default"


async def _pages(http, url: str) -> dict:
    import httpx

    try:
        response = await http.get(f"{url}/metrics")
    except httpx.HTTPError as exc:
        return {"total": None, "free": None, "used": None, "error": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"total": None, "free": None, "used": None, "error": f"/metrics answered {response.status_code}"}
    return kv_pages(parse_metrics(response.text))


async def _counters(http, url: str) -> dict[str, float] | None:
    """This runtime's counters from /metrics (report.COUNTERS; those the server lacks are absent); None when
    /metrics cannot be read."""
    import httpx

    try:
        response = await http.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return counters(parse_metrics(response.text))


async def _settled_pages(http, url: str, before: dict) -> tuple[dict, bool | None]:
    """Poll /metrics until every page is free (or PAGES_SETTLE_S passes); returns the last reading."""
    waited = Stopwatch()
    while True:
        pages = await _pages(http, url)
        ok = pages_returned(pages)
        if ok is not False or waited.seconds > PAGES_SETTLE_S:
            if before.get("total") is not None and pages.get("total") not in (None, before["total"]):
                ok = False  # the pool must never change size
            return pages, ok
        await asyncio.sleep(0.25)
