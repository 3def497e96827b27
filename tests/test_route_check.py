"""The routing check's logic (tools/experiments/fleet.py, route_check.py) without a router or a model: two in-process
stand-in backends that count their requests with the server's own ServerMetrics and drain like `serve` does (503
on new requests, running ones finish, then gone), behind a pass-through that picks one per request. The live run
with sglang-router in front of two real servers is the measurement (docs/fleet.md); this checks the counting."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from oval_edge.runtime.server.metrics import ServerMetrics
from oval_edge.tools.experiments import fleet, route_check

httpx = pytest.importorskip("httpx")


class StandIn:
    """One backend: /health, /metrics and a streaming /v1/chat/completions; signal() starts a drain."""

    def __init__(self):
        self.metrics = ServerMetrics(lambda: ("draining" if self.draining else "ready", None))
        self.draining = self.exited = False
        self.running = 0
        self.drained = asyncio.Event()
        self.ended_after_signal: list[tuple[str, bool]] = []  # what serve's log says after its drain line

    async def __call__(self, scope, receive, send):
        if self.exited:
            raise ConnectionRefusedError("stand-in backend has exited")
        path = scope["path"]
        if path == "/metrics":
            text = self.metrics.render()[0].decode() + f"oval_edge_requests_running {self.running}\n"
            return await _answer(send, 200, text.encode())
        if path == "/health":
            return await _answer(send, 503 if self.draining else 200, b"{}")
        await receive()
        if self.draining:
            self._observe("unavailable", arrived_draining=True)
            return await _answer(send, 503, b'{"error": {"message": "shutting down"}}')
        self.running += 1
        arrived_draining = self.draining
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in ({"role": "assistant"}, {"content": "a"}, {"content": "b"}):
            await asyncio.sleep(0.005)  # other requests interleave, as on a real server
            await _sse(send, {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": chunk}]})
        await _sse(send, {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                          "finish_reason": "length"}]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        self.running -= 1
        self._observe("length", arrived_draining)
        if self.draining and self.running == 0:
            self.drained.set()

    def _observe(self, outcome: str, arrived_draining: bool) -> None:
        self.metrics.observe("chat.completions", outcome)
        if self.draining:
            self.ended_after_signal.append((outcome, not arrived_draining))

    def signal(self) -> None:
        self.draining = True
        if self.running == 0:
            self.drained.set()

    async def wait_exit(self) -> int:
        await self.drained.wait()
        self.exited = True
        return 0


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


async def _sse(send, chunk: dict) -> None:
    await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})


def _fleet(skip_draining: bool):
    """Two stand-ins and a round-robin pass-through over them (skipping draining ones when told to)."""
    backends = [StandIn(), StandIn()]
    turn = [0]

    async def router(scope, receive, send):
        live = [b for b in backends if not b.exited and not (skip_draining and b.draining)]
        turn[0] += 1
        await live[turn[0] % len(live)](scope, receive, send)

    mounts = {"http://router": httpx.ASGITransport(app=router)}
    mounts.update({f"http://b{i}": httpx.ASGITransport(app=b) for i, b in enumerate(backends)})
    return backends, mounts


async def _check(skip_draining: bool):
    backends, mounts = _fleet(skip_draining)
    async with httpx.AsyncClient(mounts=mounts) as http:
        burst = await fleet.burst(http, "http://router", ["http://b0", "http://b1"], "m", clients=8, max_tokens=2)
        stopped = backends[0]
        victim = fleet.Victim("http://b0", stopped.signal, stopped.wait_exit,
                              ended_after_signal=lambda: stopped.ended_after_signal)
        failover = await fleet.failover(http, "http://router", "http://b1", victim, "m", clients=8, max_tokens=2,
                                        stop_after_s=0.3, run_s=1.0)
    return burst, failover


def test_a_router_that_drops_the_draining_backend_passes():
    burst, failover = asyncio.run(_check(skip_draining=True))
    assert burst["completed"] == 8 and burst["served_per_backend"] == [4.0, 4.0]
    assert failover["client_5xx_or_broken"] == 0 and failover["completed"] == failover["requests"]
    assert failover["stopped_completed_after_signal"] == failover["in_flight_on_stopped_at_signal"] > 0
    assert failover["stopped_admitted_after_signal"] == 0
    assert failover["stopped_refused_after_signal"] == 0 and failover["stopped_exit_code"] == 0
    assert failover["started_after_exit"] > 0 and failover["completed_after_exit"] == failover["started_after_exit"]
    # every completion was counted by exactly one backend, and both served in this phase
    assert failover["stopped_served"] + failover["survivor_served"] == failover["completed"]
    assert failover["stopped_served"] > 0 and failover["survivor_served"] > 0
    assert fleet.verdict(burst, failover, clients=8) == []
    taken = fleet.verdict(burst, {**failover, "stopped_admitted_after_signal": 1}, clients=8)
    assert taken == ["failover: the stopped server took 1 new requests after the signal"]


def test_a_router_that_keeps_sending_to_the_draining_backend_fails():
    burst, failover = asyncio.run(_check(skip_draining=False))
    # Every other new request hits the draining stand-in and its 503 reaches the client.
    assert failover["client_5xx_or_broken"] > failover["in_flight_on_stopped_at_signal"]
    assert failover["stopped_refused_after_signal"] == failover["client_5xx_or_broken"]
    assert any("failed at the client" in p for p in fleet.verdict(burst, failover, clients=8))


def test_outcome_counts_read_the_servers_own_exposition():
    metrics = ServerMetrics(lambda: ("ready", None))
    for outcome in ("length", "length", "stop", "unavailable"):
        metrics.observe("chat.completions", outcome)
    metrics.observe("completions", "stop")
    counts = fleet.outcome_counts(metrics.render()[0].decode())
    assert counts == {"length": 2.0, "stop": 2.0, "unavailable": 1.0} and fleet.completed(counts) == 4.0


def test_route_check_without_the_router_says_how_to_get_it(capsys):
    assert route_check.main(["--router-python", sys.executable + "-missing"]) == 2
    assert "pip install sglang-router" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        route_check.main(["--stop-after", "90", "--run-seconds", "60"])
    assert "--stop-after=90.0 must be above 0 and below" in capsys.readouterr().err


def test_the_stopped_servers_log_counts_what_ended_after_the_signal():
    log = ("2026-12-02 14:11:51,717 INFO oval_edge.server: chatcmpl-1 chat.completions prompt=51 completion=24 "
           "ttft=10.9s total=12.9s outcome=length\n"
           f"2026-12-02 14:11:53,791 INFO oval_edge.server: signal 15: {route_check.DRAIN_LOG} only)\n"
           "2026-12-02 14:11:55,610 INFO oval_edge.server: chatcmpl-2 chat.completions prompt=51 completion=24 "
           "ttft=12.2s total=13.7s outcome=length\n"
           "2026-12-02 14:11:55,700 INFO oval_edge.server: chatcmpl-3 chat.completions prompt=0 completion=0 ttft=- "
           "total=0.001s outcome=unavailable(503): the server is shutting down and takes no new requests\n"
           "2026-12-02 14:11:56,500 INFO oval_edge.server: chatcmpl-4 chat.completions prompt=51 completion=24 "
           "ttft=2.0s total=2.500s outcome=length\n")
    # chatcmpl-2 arrived at 14:11:41.910, before the signal; chatcmpl-4 at 14:11:54.000, after it (a bug to catch)
    assert route_check.ended_after_signal(log) == [("length", True), ("unavailable", False), ("length", False)]
    assert route_check.ended_after_signal(log.split("2026-12-02 14:11:53")[0]) == []  # never signalled
