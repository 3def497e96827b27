"""Live routing check: two `oval-edge serve` instances behind SGLang's router (`sglang-router` from PyPI), one endpoint.

    pip install sglang-router          # optional tool, not a dependency: a Rust router with a Python launcher
    python -m oval_edge.tools.experiments.route_check [--router-python /path/to/that/env/bin/python] [--json out.json]

1. 32 concurrent streaming chats through the router: every one must complete, and both servers must have served
   some (each server's own /metrics counts its generation requests by outcome).
2. Clients keep streaming; one server gets SIGTERM mid-run. It drains (/health 503, running requests finish within
   --shutdown-grace, new ones get 503) and exits 0. New requests must move to the other server, and the client may
   see no 5xx beyond the requests that were running or queued on the stopped server at the signal.
The router health-checks GET /health, by default every 60 s with 3 failures before it drops a worker: minutes of
routing to a draining server. This check runs it with a 1 s interval and 1 failure (ROUTER_HEALTH), so the 503 of a
draining server drops it within about a second. Exit status 0 when both phases hold; 2 without the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from . import fleet
from ..load.server import LOOPBACK, AutoServer, free_port

SERVE_ARGS = "--device cpu --max-batch 4 --threads 1 --shutdown-grace 20"
ROUTER_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1", "--health-check-timeout-secs", "2"]
DRAIN_LOG = "draining (no new requests"  # serve's log line at the first SIGTERM
_ENDED = re.compile(r" total=([0-9.]+)s outcome=([a-z_]+)")  # serve's one line per request, at its end
LOG_TOLERANCE_S = 0.005  # the log's millisecond clock and total's 3 decimals
NUMBERS = (("--clients", int, 32, "concurrent streaming clients"), ("--max-tokens", int, 24, "tokens per request"),
           ("--run-seconds", float, 60.0, "length of the failover phase"),
           ("--stop-after", float, 20.0, "SIGTERM one server this far into it"))
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def router_version(python: str) -> str | None:
    """The sglang-router release importable by `python`, or None when it is not installed there."""
    try:
        probe = subprocess.run([python, "-c", "import importlib.metadata as m, sglang_router.launch_router; "
                                "print(m.version('sglang-router'))"], capture_output=True, text=True)
    except OSError:  # no such interpreter
        return None
    return probe.stdout.strip() if probe.returncode == 0 else None


def _log_time(line: str) -> float:
    """Seconds of the day from serve's log timestamp `YYYY-MM-DD HH:MM:SS,mmm` (a drain never spans midnight
    in a run of minutes; if one does, the arrivals read as before the signal and the check errs to passing)."""
    clock = line[11:23]
    return int(clock[0:2]) * 3600 + int(clock[3:5]) * 60 + int(clock[6:8]) + int(clock[9:12]) / 1000


def ended_after_signal(log_text: str) -> list[tuple[str, bool]]:
    """(outcome, arrived before the signal?) of each request serve logged after its drain line: the line's time
    minus its `total=` is when the request arrived."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines) if DRAIN_LOG in line), None)
    if start is None:
        return []
    signal_at = _log_time(lines[start])
    ended = []
    for line in lines[start + 1:]:
        found = _ENDED.search(line)
        if found:
            arrived = _log_time(line) - float(found.group(1))
            ended.append((found.group(2), arrived <= signal_at + LOG_TOLERANCE_S))
    return ended


def router_command(python: str, port: int, policy: str, workers: list[str], health: list[str]) -> list[str]:
    return [python, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()), "--policy", policy,
            *health, "--worker-urls", *workers]


async def router_health(http, router: str) -> dict[str, bool]:
    """{worker url: healthy} as the router's GET /workers reports it."""
    workers = (await http.get(router + "/workers", timeout=5.0)).json()["workers"]
    return {w["url"]: bool(w["is_healthy"]) for w in workers}


async def wait_router(http, router: str, workers: list[str], process: subprocess.Popen, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline, last = loop.time() + timeout_s, "no answer yet"
    while loop.time() < deadline:
        if process.poll() is not None:
            raise ValueError(f"the router exited with {process.returncode} before it was ready")
        try:
            health = await router_health(http, router)
            if all(health.get(url) for url in workers):
                return
            last = f"workers {health}"
        except Exception as exc:  # noqa: BLE001 - not listening yet
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.5)
    raise ValueError(f"the router at {router} did not report both workers healthy in {timeout_s:.0f} s ({last})")


async def _measure(router: str, servers: list[AutoServer], process, args) -> dict:
    import httpx

    urls = [s.url for s in servers]
    victim_process = servers[0].process

    async def routed() -> bool | None:
        try:
            return (await router_health(http, router)).get(urls[0])
        except Exception:  # noqa: BLE001 - the router's answer is a report, not a condition of the run
            return None

    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as http:
        await wait_router(http, router, urls, process, 120)
        model = (await http.get(urls[1] + "/v1/models")).json()["data"][0]["id"]
        burst = await fleet.burst(http, router, urls, model, args.clients, args.max_tokens)
        victim = fleet.Victim(urls[0], lambda: victim_process.send_signal(signal.SIGTERM),
                              lambda: asyncio.to_thread(victim_process.wait, 120), routed,
                              lambda: ended_after_signal(servers[0].log_tail(10**8)))
        failover = await fleet.failover(http, router, urls[1], victim, model, args.clients, args.max_tokens,
                                        args.stop_after, args.run_seconds)
    return {"burst": burst, "failover": failover}


def run(args: argparse.Namespace, version: str) -> dict:
    health = [] if args.router_default_health else ROUTER_HEALTH
    servers = [AutoServer(args.serve_args).start() for _ in range(2)]
    port = free_port()
    router = f"http://{LOOPBACK}:{port}"
    log_path = os.path.join(tempfile.mkdtemp(prefix="oval-router-"), "router.log")
    process = None
    try:
        for server in servers:
            server.wait_ready(900)
        command = router_command(args.router_python, port, args.policy, [s.url for s in servers], health)
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        phases = asyncio.run(_measure(router, servers, process, args))
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
        for server in servers:
            server.stop()
    problems = fleet.verdict(phases["burst"], phases["failover"], args.clients)
    return {"router": f"sglang-router {version}", "policy": args.policy,
            "router_flags": " ".join(health) or "(its defaults)", "serve_args": args.serve_args, "clients": args.clients, "max_tokens": args.max_tokens,
            "stop_after_s": args.stop_after, "run_s": args.run_seconds, **phases, "router_log": log_path,
            "problems": problems, "ok": not problems}


def _check(args: argparse.Namespace) -> None:
    if not 2 <= args.clients <= 1024:
        raise ValueError(f"--clients={args.clients} is out of range: give 2..1024")
    if not 1 <= args.max_tokens <= 4096:
        raise ValueError(f"--max-tokens={args.max_tokens} is out of range: give 1..4096")
    if not 0 < args.stop_after < args.run_seconds:
        raise ValueError(f"--stop-after={args.stop_after} must be above 0 and below --run-seconds={args.run_seconds}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oval_edge.tools.experiments.route_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--router-python", default=sys.executable,
                        help="a Python with sglang-router installed (default: this one)")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the router's policy (its default)")
    parser.add_argument("--serve-args", default=SERVE_ARGS, help=f"for both servers (default: {SERVE_ARGS})")
    for flag, kind, default, text in NUMBERS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    parser.add_argument("--router-default-health", action="store_true",
                        help="leave the router's health checks at its defaults (to see what ROUTER_HEALTH changes)")
    parser.add_argument("--json", dest="json_path", help="write the report here too")
    args = parser.parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        parser.error(str(exc))
    version = router_version(args.router_python)
    if version is None:
        print(f"route_check: sglang-router is not importable by {args.router_python}; `pip install sglang-router` "
              "there, or pass --router-python", file=sys.stderr)
        return 2
    report = run(args, version)
    print(json.dumps(report, indent=2))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
