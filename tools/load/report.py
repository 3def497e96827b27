"""What the load test concludes: percentiles, outcome counts, the KV-page check and engine counters from /metrics,
and the printout."""

from __future__ import annotations

import re

from oval_edge.tools.timing import percentile, rate

from .client import RequestResult

# Prometheus text exposition: `name{labels} value [timestamp]`; we need only the name and the value.
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
# This runtime's counters (runtime/server/metrics.py) read before and after the load, by the end of their name
# (any prefix); another server (llama-server) exports none of them and the report says "unknown".
COUNTERS = {"prefix_hit_tokens": "prefix_cache_hit_tokens_total",
            "prefix_query_tokens": "prefix_cache_query_tokens_total",
            "preemptions": "requests_preempted_total", "mixed_steps": "mixed_steps_total"}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labelled samples summed per name (one pool per server)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if match.group(2) and "_bucket" in match.group(1):
            continue
        values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


def kv_pages(metrics: dict[str, float]) -> dict[str, float | None]:
    """Total / free / used KV pages from whatever gauges the server names them (…kv…pages_total/free/used)."""
    def find(word: str) -> float | None:
        names = [n for n in metrics if "page" in n.lower() and word in n.lower() and not n.endswith("_created")]
        names.sort(key=lambda n: ("kv" not in n.lower(), len(n)))  # the KV pool's gauge before e.g. selection stats
        return metrics[names[0]] if names else None

    total, free, used = find("total"), find("free"), find("used")
    if free is None and total is not None and used is not None:
        free = total - used
    if used is None and total is not None and free is not None:
        used = total - free
    return {"total": total, "free": free, "used": used}


def counters(metrics: dict[str, float]) -> dict[str, float]:
    """The COUNTERS the server exports, by their short names; a counter it lacks is absent."""
    found = {}
    for key, suffix in COUNTERS.items():
        value = next((v for name, v in metrics.items() if name.endswith(suffix)), None)
        if value is not None:
            found[key] = value
    return found


def counter_changes(before: dict | None, after: dict | None) -> dict:
    """Summary entries from counter readings before and after the load: preemptions and mixed_steps (None: the
    server has no such counter), and prefix_hit_ratio only when the run looked prompt tokens up in a prefix cache."""
    before, after = before or {}, after or {}

    def change(key: str) -> float | None:
        return after[key] - before[key] if key in before and key in after else None

    out: dict = {}
    for key in ("preemptions", "mixed_steps"):
        value = change(key)
        out[key] = None if value is None else int(value)
    hits, asked = change("prefix_hit_tokens"), change("prefix_query_tokens")
    if hits is not None and asked is not None and asked > 0:  # this server counts prefix-cache hits
        out["prefix_hit_ratio"] = hits / asked
    return out


def pages_returned(pages: dict[str, float | None]) -> bool | None:
    """True when every page is free again; None when /metrics names no page gauges."""
    if pages["total"] is None or pages["free"] is None:
        return None
    return pages["free"] == pages["total"]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    by_outcome: dict[str, int] = {"completed": 0, "busy": 0, "rejected": 0, "error": 0}
    for r in results:
        by_outcome[r.outcome] += 1
    completed = [r for r in results if r.outcome == "completed"]
    streams = [r for r in results if r.well_formed is not None and r.status == 200]
    tokens = sum(r.completion_tokens for r in completed)
    server_errors = [r for r in results if r.status is not None and r.status >= 500
                     and not (r.status == 503 and r.retry_after is not None)]
    ttft = [r.ttft_s for r in completed if r.ttft_s is not None]
    latency = [r.latency_s for r in completed if r.latency_s is not None]
    itl = [gap * 1000 for r in completed for gap in r.itl_s]  # every gap of every completed stream, in ms
    return {
        "requests": len(results), **by_outcome,
        "server_errors_5xx": len(server_errors),
        "streams": len(streams), "streams_well_formed": sum(1 for r in streams if r.well_formed),
        "completion_tokens": tokens, "wall_s": wall_s,
        "aggregate_tok_s": rate(tokens, wall_s),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "latency_p50_s": percentile(latency, 50), "latency_p95_s": percentile(latency, 95),
        "itl_p50_ms": percentile(itl, 50), "itl_p95_ms": percentile(itl, 95), "itl_samples": len(itl),
        "finish_reasons": _count(r.finish_reason for r in completed),
        "first_errors": [f"client {r.client} request {r.index}: {r.error or r.problem}" for r in results
                         if r.outcome in ("error", "rejected") or r.well_formed is False][:10],
    }


def verdict(summary: dict, pages_ok: bool | None) -> list[str]:
    """What failed the bar (empty: every request completed or got a deliberate 503, no 5xx, all streams
    well-formed, every page back)."""
    problems = []
    if summary["error"] or summary["rejected"]:
        problems.append(f"{summary['error']} request(s) failed and {summary['rejected']} were rejected (4xx)")
    if summary["server_errors_5xx"]:
        problems.append(f"{summary['server_errors_5xx']} 5xx response(s) other than 503 with Retry-After")
    if summary["streams_well_formed"] != summary["streams"]:
        problems.append(f"{summary['streams'] - summary['streams_well_formed']} malformed stream(s)")
    if pages_ok is False:
        problems.append("KV pages did not return to the total after the load")
    elif pages_ok is None:
        problems.append("/metrics shows no KV page gauges (total/free): the page check could not run")
    return problems


def format_summary(summary: dict, pages: dict, pages_ok: bool | None, setup: dict) -> str:
    def sec(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    def ms(v):
        return "-" if v is None else f"{v:.1f} ms"

    def count(key):
        return "unknown" if summary.get(key) is None else str(summary[key])

    lines = [
        f"load test: {setup['clients']} concurrent streaming clients x {setup['requests_per_client']} requests, "
        f"max_tokens {setup['max_tokens']}, against {setup['url']}",
        f"  requests            {summary['requests']}: {summary['completed']} completed, {summary['busy']} busy "
        f"(503 + Retry-After), {summary['rejected']} rejected (4xx), {summary['error']} errors",
        f"  5xx (not 503+Retry) {summary['server_errors_5xx']}",
        f"  streams well-formed {summary['streams_well_formed']}/{summary['streams']}",
        f"  time to first token p50 {sec(summary['ttft_p50_s'])}, p95 {sec(summary['ttft_p95_s'])}",
        f"  inter-token latency p50 {ms(summary.get('itl_p50_ms'))}, p95 {ms(summary.get('itl_p95_ms'))}",
        f"  request latency     p50 {sec(summary['latency_p50_s'])}, p95 {sec(summary['latency_p95_s'])}",
        f"  aggregate           {summary['completion_tokens']} tokens in {summary['wall_s']:.1f} s = "
        f"{summary['aggregate_tok_s'] or 0:.1f} tok/s",
        f"  finish reasons      {summary['finish_reasons']}",
        f"  engine counters     preemptions {count('preemptions')}, mixed steps {count('mixed_steps')} "
        "(over the run)",
        f"  KV pages after      total {_int(pages.get('total'))}, free {_int(pages.get('free'))}, used "
        f"{_int(pages.get('used'))}: " + {True: "all returned", False: "NOT all returned", None: "unknown"}[pages_ok],
    ]
    if summary.get("prefix_hit_ratio") is not None:
        lines.append(f"  prefix cache        {summary['prefix_hit_ratio']:.1%} of prompt tokens served from cached pages")
    lines += [f"  ! {e}" for e in summary["first_errors"]]
    return "\n".join(lines)


def _int(value) -> str:
    return "?" if value is None else str(int(value))


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out
