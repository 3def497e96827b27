"""What a soak (tools/load/soak.py) concludes: outcome counts, whether RSS stayed flat after the warm-up, the
verdict, the printout and the plot of RSS and KV pages over time."""

from __future__ import annotations

from collections import Counter

WARMUP_FRACTION = 0.25  # RSS is judged from the first sample after this share of the run
RSS_TOLERANCE = 0.05


def summarize(outcomes: list, samples: list[dict], warmup_s: float, server_cancelled: int) -> dict:
    """Counts by result and by kind, content notes of the successful requests, the last page reading, RSS."""
    results = Counter(o.result for o in outcomes)
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.result] += 1
    return {"requests": len(outcomes), "server_errors_5xx": results["server_error"], "errors": results["error"],
            "rejected": results["rejected"], "busy": results["busy"],
            "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
            "server_cancelled": server_cancelled,
            "notes": dict(Counter(f"{o.kind}: {o.note}" for o in outcomes if o.result == "ok" and o.note)),
            "first_failures": [vars(o) for o in outcomes if o.result in ("error", "rejected", "server_error")][:10],
            "pages_end": samples[-1], "rss": rss_flatness(samples, warmup_s)}


def rss_flatness(samples: list[dict], warmup_s: float) -> dict:
    """RSS at the start, at the end of the warm-up (the reference) and at the end, and the largest move from the
    reference afterwards, as a fraction of it (None where RSS was not read)."""
    readings = [(s["t_s"], s["rss_bytes"]) for s in samples if s.get("rss_bytes")]
    after = [rss for t, rss in readings if t >= warmup_s]
    if not readings or not after:
        return {"start": None, "reference": None, "end": None, "max": None, "largest_move": None}
    reference = after[0]
    return {"start": readings[0][1], "reference": reference, "end": after[-1], "max": max(after),
            "largest_move": max(abs(rss - reference) for rss in after) / reference}


def verdict(summary: dict, kinds: set[str], settle_s: float) -> list[str]:
    problems = []
    if summary["server_errors_5xx"]:
        problems.append(f"{summary['server_errors_5xx']} 5xx response(s) other than 503 with Retry-After")
    if summary["errors"] or summary["rejected"]:
        problems.append(f"{summary['errors']} request(s) failed and {summary['rejected']} were rejected (4xx)")
    missing = sorted(k for k in kinds if not summary["by_kind"].get(k, {}).get("cancelled" if k == "cancel" else "ok"))
    if missing:
        problems.append(f"no request of kind {', '.join(missing)} succeeded: the mix was not exercised")
    used = summary["pages_end"]["pages_used"]
    if used is None:
        problems.append("/metrics showed no KV page gauges at the end: the page check could not run")
    elif used != 0:
        problems.append(f"{used:g} KV page(s) still used {settle_s:.0f} s after the last request")
    move = summary["rss"]["largest_move"]
    if move is None:
        problems.append("RSS was not read: give --pid of the server (or run the soak on its machine)")
    elif move > RSS_TOLERANCE:
        problems.append(f"RSS moved {move:.1%} from its reading after the warm-up (allowed {RSS_TOLERANCE:.0%})")
    return problems


def format_report(report: dict) -> str:
    s, rss = report["summary"], report["summary"]["rss"]
    mib = lambda v: "-" if v is None else f"{v / 2**20:.1f} MiB"  # noqa: E731
    lines = [f"soak: {report['setup']['clients']} clients for {report['setup']['minutes']:g} min against "
             f"{report['setup']['url']}",
             f"  requests      {s['requests']}: 5xx {s['server_errors_5xx']}, errors {s['errors']}, rejected "
             f"{s['rejected']}, busy (503 + Retry-After) {s['busy']}",
             *(f"  {kind:<13} {counts}" for kind, counts in sorted(s["by_kind"].items())),
             f"  cancels       {s['server_cancelled']} counted by the server",
             f"  KV pages end  {s['pages_end']['pages_used']} used of {s['pages_end']['pages_total']}",
             f"  RSS           start {mib(rss['start'])}, after warm-up {mib(rss['reference'])}, end "
             f"{mib(rss['end'])}, max {mib(rss['max'])}; largest move after warm-up "
             + ("-" if rss["largest_move"] is None else f"{rss['largest_move']:.2%}"),
             *(f"  note          {note}: {n}" for note, n in sorted(s["notes"].items()))]
    lines += [f"  FAIL: {p}" for p in report["problems"]] or ["  OK: no 5xx, no failures, every page free, RSS flat"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """RSS and KV pages used over the soak, the warm-up shaded and the RSS tolerance band drawn (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, rss = report["samples"], report["summary"]["rss"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=90)
    top.plot(minutes, [(s["rss_bytes"] or float("nan")) / 2**20 for s in samples], color="tab:blue")
    if rss["reference"]:
        ref = rss["reference"] / 2**20
        top.axhspan(ref * (1 - RSS_TOLERANCE), ref * (1 + RSS_TOLERANCE), color="tab:blue", alpha=0.1,
                    label=f"±{RSS_TOLERANCE:.0%} of the reading after warm-up")
        top.legend(loc="lower right")
    top.set_ylabel("server RSS (MiB)")
    bottom.step(minutes, [s["pages_used"] for s in samples], where="post", color="tab:orange")
    bottom.set_ylabel(f"KV pages used (of {int(samples[-1]['pages_total'] or 0)})")
    bottom.set_xlabel("minutes")
    for axis in (top, bottom):
        axis.axvspan(0, report["setup"]["warmup_s"] / 60, color="grey", alpha=0.15)
        axis.grid(alpha=0.3)
    top.set_title(f"soak: {report['summary']['requests']} requests, {report['setup']['clients']} clients "
                  "(warm-up shaded)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
