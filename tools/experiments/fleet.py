"""The two phases of the routing check (tools/experiments/route_check.py) and what they conclude, apart from how the
servers and the router are started: anything that speaks HTTP at the URLs given is measured the same way.

Per-backend traffic is read from each server's own /metrics (`oval_edge_http_requests_total` by outcome), because
the router's answers do not say which backend served them.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..load.client import RequestResult, stream_chat
from ..load.report import parse_metrics
from ..timing import Stopwatch, clock

COMPLETED = ("stop", "length")  # outcomes of oval_edge_http_requests_total that delivered a whole answer
REFUSED = ("unavailable", "busy", "rejected")  # answered at once with an error: never in flight
_REQUESTS = re.compile(r'^oval_edge_http_requests_total\{([^}]*)\}\s+(\S+)', re.MULTILINE)
_OUTCOME = re.compile(r'outcome="([^"]*)"')
POLL_S = 0.25  # how often the stopped server and the router are watched while it drains


def outcome_counts(text: str) -> dict[str, float]:
    """Prometheus text -> {outcome: generation requests}, summed over endpoints."""
    counts: dict[str, float] = {}
    for labels, value in _REQUESTS.findall(text):
        found = _OUTCOME.search(labels)
        if found:
            counts[found.group(1)] = counts.get(found.group(1), 0.0) + float(value)
    return counts


def completed(counts: dict[str, float]) -> float:
    return sum(counts.get(name, 0.0) for name in COMPLETED)


async def read_counts(http, url: str) -> tuple[dict[str, float], dict[str, float]] | None:
    """(outcome counts, all samples) from url/metrics, or None when the server no longer answers."""
    try:
        response = await http.get(url + "/metrics", timeout=5.0)
    except Exception:  # noqa: BLE001 - a stopped server refusing the connection is the expected case here
        return None
    if response.status_code != 200:
        return None
    return outcome_counts(response.text), parse_metrics(response.text)


def chat_body(model: str, client: int, index: int, max_tokens: int) -> dict:
    # A different prompt per request, so a prefix-aware policy has no reason to send everything to one server.
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Client {client}, request {index}: describe a harbour at "
                                                     f"dawn, detail {client * 31 + index}."}]}


def failed(result: RequestResult) -> bool:
    """What the issue counts against the router: a 5xx (a draining server's 503 included), a refused connection,
    or a stream broken after its 200."""
    return result.status is None or result.status >= 500 or result.outcome == "error"


async def burst(http, router: str, backends: list[str], model: str, clients: int, max_tokens: int) -> dict:
    """`clients` concurrent streaming chats at once; how many completed and how many each backend served."""
    before = [await read_counts(http, url) for url in backends]
    results = await asyncio.gather(*(stream_chat(http, router, chat_body(model, i, 0, max_tokens), {}, i, 0)
                                     for i in range(clients)))
    after = [await read_counts(http, url) for url in backends]
    return {"requests": len(results), "completed": sum(r.outcome == "completed" for r in results),
            "served_per_backend": [completed(a[0]) - completed(b[0]) for a, b in zip(after, before)],
            "errors": sorted({(r.error or r.problem or "")[:160] for r in results if r.outcome != "completed"})}


@dataclass
class Victim:
    """The backend that gets stopped: its URL, how to signal it, how to wait for its exit code, and (optional) how
    to ask the router whether it still routes to it (True/False, None when the router cannot say)."""

    url: str
    signal: Callable[[], None]
    wait_exit: Callable[[], Awaitable[int | None]]
    routed: Callable[[], Awaitable[bool | None]] | None = None
    # After the exit: (outcome, arrived before the signal?) of each request that ended after the signal (the server's
    # log). Exact, where the last /metrics reading before the exit can miss the final completions, and where the
    # engine's gauges at the signal miss requests whose last bytes were still being sent.
    ended_after_signal: Callable[[], list[tuple[str, bool]]] | None = None


async def _watch_stop(http, victim: Victim, marks: dict) -> None:
    """SIGTERM the victim and follow its drain: its last /metrics before it went away, when the router dropped it."""
    at_signal = await read_counts(http, victim.url)
    if at_signal is None:
        raise ValueError(f"{victim.url} did not answer /metrics before the signal; it must be up to be stopped")
    marks["counts_at_signal"], samples = at_signal
    marks["running_at_signal"] = samples.get("oval_edge_requests_running", 0.0)
    marks["waiting_at_signal"] = samples.get("oval_edge_requests_waiting", 0.0)
    marks["signal_at"] = clock()
    victim.signal()
    exit_task = asyncio.create_task(victim.wait_exit())
    last = marks["counts_at_signal"]
    while not exit_task.done():
        reading = await read_counts(http, victim.url)
        if reading is not None:
            last = reading[0]
        if victim.routed is not None and "router_dropped_at" not in marks and await victim.routed() is False:
            marks["router_dropped_at"] = clock()
        await asyncio.sleep(POLL_S)
    marks["exit_code"] = exit_task.result()
    marks["exited_at"] = clock()
    marks["counts_last"] = last
    marks["ended"] = None if victim.ended_after_signal is None else victim.ended_after_signal()


async def failover(http, router: str, survivor: str, victim: Victim, model: str, clients: int, max_tokens: int,
                   stop_after_s: float, run_s: float) -> dict:
    """Clients stream back to back through the router for run_s; the victim gets SIGTERM at stop_after_s."""
    rows: list[tuple[float, RequestResult]] = []  # (start time, result)
    marks: dict = {}
    survivor_before, victim_before = await read_counts(http, survivor), await read_counts(http, victim.url)
    running = Stopwatch()

    async def client(cid: int) -> None:
        index = 1
        while running.seconds < run_s:
            start = clock()
            rows.append((start, await stream_chat(http, router, chat_body(model, cid, index, max_tokens), {}, cid,
                                                  index)))
            index += 1

    async def stopper() -> None:
        await asyncio.sleep(stop_after_s)
        await _watch_stop(http, victim, marks)

    await asyncio.gather(stopper(), *(client(i) for i in range(clients)))
    survivor_after = await read_counts(http, survivor)
    marks["counts_before"] = victim_before[0]
    return summarize_failover(rows, marks, completed(survivor_after[0]) - completed(survivor_before[0]))


def summarize_failover(rows: list[tuple[float, RequestResult]], marks: dict, survivor_served: float) -> dict:
    """Counts of the failover phase; times are seconds after the signal."""
    signal_at, exited_at = marks["signal_at"], marks["exited_at"]
    bad = [r for _, r in rows if failed(r)]
    after_exit = [r for start, r in rows if start > exited_at]
    at_signal, last, ended = marks["counts_at_signal"], marks["counts_last"], marks["ended"]
    if ended is not None:  # the log's account replaces the last /metrics reading
        last = dict(at_signal)
        for outcome, _ in ended:
            last[outcome] = last.get(outcome, 0.0) + 1
    answered = [before for outcome, before in ended or () if outcome not in REFUSED]
    dropped = marks.get("router_dropped_at")
    return {
        "requests": len(rows),
        "completed": sum(r.outcome == "completed" for _, r in rows),
        "client_5xx_or_broken": len(bad),
        "errors": sorted({(r.error or r.problem or "")[:160] for r in bad}),
        "gauges_at_signal": {"running": marks["running_at_signal"], "waiting": marks["waiting_at_signal"]},
        # requests the stopped server had taken and not yet ended when it got the signal (its log; else its gauges)
        "in_flight_on_stopped_at_signal": (sum(answered) if ended is not None
                                           else marks["running_at_signal"] + marks["waiting_at_signal"]),
        "stopped_admitted_after_signal": None if ended is None else len(answered) - sum(answered),
        "stopped_completed_after_signal": completed(last) - completed(at_signal),
        # 503s the draining server answered (the router saw them; the client only when the router passed them on)
        "stopped_refused_after_signal": last.get("unavailable", 0.0) - at_signal.get("unavailable", 0.0),
        "stopped_counted_from": "metrics" if ended is None else "log",
        "stopped_exit_code": marks["exit_code"],
        "drain_s": exited_at - signal_at,
        "router_dropped_after_s": None if dropped is None else dropped - signal_at,
        "started_after_exit": len(after_exit),
        "completed_after_exit": sum(r.outcome == "completed" for r in after_exit),
        "stopped_served": completed(last) - completed(marks["counts_before"]),
        "survivor_served": survivor_served,
    }


def verdict(burst_report: dict, failover_report: dict, clients: int) -> list[str]:
    """What failed, in words; empty when the routing check holds."""
    problems = []
    b, f = burst_report, failover_report
    if b["completed"] != clients:
        problems.append(f"burst: {b['completed']} of {clients} streams completed ({'; '.join(b['errors'])})")
    if min(b["served_per_backend"]) <= 0:
        problems.append(f"burst: a backend served nothing (per backend {b['served_per_backend']})")
    in_flight = f["in_flight_on_stopped_at_signal"]
    if f["client_5xx_or_broken"] > in_flight:
        problems.append(f"failover: {f['client_5xx_or_broken']} requests failed at the client, more than the "
                        f"{in_flight:.0f} in flight on the stopped server ({'; '.join(f['errors'])})")
    if f["stopped_admitted_after_signal"]:
        problems.append(f"failover: the stopped server took {f['stopped_admitted_after_signal']} new requests "
                        "after the signal")
    if f["started_after_exit"] == 0 or f["completed_after_exit"] != f["started_after_exit"]:
        problems.append(f"failover: {f['completed_after_exit']} of {f['started_after_exit']} requests started after "
                        "the stopped server exited completed (need all, and some)")
    if f["stopped_exit_code"] != 0:
        problems.append(f"failover: the stopped server exited {f['stopped_exit_code']}, not 0")
    return problems
