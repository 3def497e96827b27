"""The soak (tools/load/soak.py): its RSS and page verdict, the listener lookup that finds the server's process, and a
1-minute soak against a real `oval-edge serve --chat-template chatml-tools` of the bundled model, run when
OVAL_EDGE_SOAK_TEST=1 (the 20-minute run and its plot: docs/soak.md)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from oval_edge.tools.load.soak import MIX, SETTLE_S, Soak, listener_pid, rss_bytes
from oval_edge.tools.load.soak_report import rss_flatness, summarize, verdict

MIB = 1 << 20
SOAK_ENV = "OVAL_EDGE_SOAK_TEST"


def _samples(rss_mib: list[float], used_at_end: float = 0) -> list[dict]:
    """One reading every 10 s with these RSS values; every page free but `used_at_end` in the last reading."""
    samples = [{"t_s": 10.0 * i, "rss_bytes": int(r * MIB), "pages_used": 0.0, "pages_total": 64.0}
               for i, r in enumerate(rss_mib)]
    samples[-1]["pages_used"] = used_at_end
    return samples


def _verdict(samples: list[dict], outcomes=()) -> list[str]:
    from oval_edge.tools.load.soak import Outcome

    ok = [Outcome(kind, 1.0, 200, "cancelled" if kind == "cancel" else "ok") for kind in MIX]
    summary = summarize([*ok, *outcomes], samples, warmup_s=20.0, server_cancelled=1)
    return verdict(summary, set(MIX), SETTLE_S)


def test_rss_is_judged_from_the_first_reading_after_the_warm_up():
    # Growth during the warm-up (100 -> 200) does not count; after it, 200 -> 209 is a 4.5% move.
    flat = rss_flatness(_samples([100, 150, 200, 205, 209, 203]), warmup_s=20.0)
    assert flat["start"] == 100 * MIB and flat["reference"] == 200 * MIB and flat["end"] == 203 * MIB
    assert flat["largest_move"] == pytest.approx(0.045, abs=1e-6)
    assert _verdict(_samples([100, 150, 200, 205, 209, 203])) == []
    assert "RSS moved 6.0%" in " ".join(_verdict(_samples([100, 150, 200, 206, 212])))
    assert "RSS was not read" in " ".join(_verdict([dict(s, rss_bytes=None) for s in _samples([1, 1, 1])]))


def test_the_verdict_names_5xx_failures_held_pages_and_an_unexercised_kind():
    from oval_edge.tools.load.soak import Outcome

    problems = " ".join(_verdict(_samples([200, 200, 200, 200], used_at_end=3),
                                 [Outcome("stream", 5.0, 500, "server_error"), Outcome("tools", 6.0, 400, "rejected")]))
    assert "1 5xx" in problems and "1 were rejected" in problems and "3 KV page(s) still used" in problems
    summary = summarize([Outcome("stream", 1.0, 200, "ok")], _samples([200, 200, 200]), 20.0, 0)
    assert "no request of kind cancel, json_schema, multiturn, tools succeeded" in " ".join(
        verdict(summary, set(MIX), SETTLE_S))


def test_listener_pid_finds_the_process_listening_on_a_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        assert listener_pid(f"http://127.0.0.1:{port}") == os.getpid()
    assert listener_pid(f"http://127.0.0.1:{port}") is None  # closed: nobody listens there
    assert listener_pid("http://192.0.2.1:8000") is None  # not this machine's: no lookup
    assert rss_bytes(os.getpid()) > 10 * MIB


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(SOAK_ENV) != "1",
                    reason=f"a 1-minute soak takes 72-83 s with the server's start and stop (over the ~60 s a test of "
                    f"the normal suite may take): {SOAK_ENV}=1 runs it")
def test_a_one_minute_soak_of_the_real_server(tmp_path):
    """Streams, abandoned streams, tool calls, json_schema and multi-turn chats for a minute: no 5xx, no failure,
    every page free at the end, RSS read all along. RSS flatness is the 20-minute run's bar (docs/soak.md): a
    minute is warm-up here (RSS rose 9% in the first minute of one run), so it is left out of this verdict."""
    from oval_edge.tools.load.server import AutoServer
    from oval_edge.tools.load.soak_report import plot

    server = AutoServer("--chat-template chatml-tools --max-batch 4 --max-context 2048 --shutdown-grace 5").start()
    try:
        server.wait_ready(600)
        assert listener_pid(server.url) == server.process.pid
        report = asyncio.run(Soak(server.url, 1.0, 4, {}, server.process.pid, sample_s=2.0).run())
    finally:
        assert server.stop() == 0, server.log_tail()
    summary, rss = report["summary"], report["summary"]["rss"]
    problems = [p for p in report["problems"] if not p.startswith("RSS moved")]
    assert problems == [], (problems, summary)
    assert rss["start"] and rss["end"] and all(s["rss_bytes"] for s in report["samples"]), rss
    assert summary["requests"] >= 20 and len(report["samples"]) >= 25, summary
    assert summary["server_cancelled"] >= summary["by_kind"]["cancel"].get("cancelled", 0) >= 1, summary
    plot(report, str(tmp_path / "soak.png"))
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
