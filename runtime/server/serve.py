"""`oval-edge serve`: the OpenAI-compatible HTTP server over the engine.

It binds the port first and answers at once (GET /health: 503 while the model loads in a background thread, 200
when ready), prints the startup report when the model is in (model, weight bytes, the pool arithmetic), and on
SIGTERM/SIGINT stops admitting (503), lets running requests finish for --shutdown-grace seconds, cancels the
rest, and exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import threading

import uvicorn

from .options import add_engine_arguments, describe_spec, engine_spec

log = logging.getLogger("oval_edge.server")

# Entries each of torch's two CPU shape caches keeps: oneDNN's primitive cache and ideep's computation cache (the
# bf16 prefill matmuls, runtime/model/grouped/linear.py). Both default to 1,024 entries of ~0.5 MiB (each entry
# holds JIT-compiled kernels for one [rows, in] x [in, out] shape), and a prompt's chunk gives every projection a
# new row count: a soak's varied prompts grew the server's RSS by ~290 MiB over 6,000 requests (docs/soak.md). At
# 16 (4 projection shapes per row count, so the last 4 row counts: a long prompt's equal chunks still hit) the two
# caches hold ~30 MiB at most; a new shape costs ~0.2 ms to build either way. An operator's own values are kept.
SHAPE_CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}


def bound_shape_caches() -> None:
    """Cap torch's CPU shape caches (SHAPE_CACHE_CAPACITY): the pool is sized once against a fixed reserve [R-pool],
    which memory that grows with the requests served would eat. They read these variables when their first entry
    is made, so this runs before the model loads (its self-checks may already multiply)."""
    for name, value in SHAPE_CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes it to the network)")
    group.add_argument("--port", type=int, help="TCP port (default: 8000; 0 picks a free one and prints it)")
    group.add_argument("--api-key", default=os.environ.get("OVAL_EDGE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                       "(default: $OVAL_EDGE_API_KEY, else open)")
    group.add_argument("--metrics-public", action="store_true",
                       help="with --api-key, leave GET /metrics open as well (routers and Prometheus scrape without "
                       "credentials; the API routes still need the key)")
    group.add_argument("--no-webui", dest="webui", action="store_false",
                       help="do not serve the chat page at GET / (then a 404); the API is unchanged")
    group.add_argument("--strict-requests", action="store_true",
                       help="refuse (400) request fields that no OpenAI request declares; by default they are "
                       "ignored and named in the X-Ignored-Fields response header, as OpenAI fields this server does "
                       "not act on are")
    group.add_argument("--max-tokens-limit", type=int, default=8192,
                       help="largest max_tokens a request may ask for (default: 8192)")
    group.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES",
                       help="largest request body; larger ones get 413 (default: 1048576)")
    group.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long running requests may finish before they are cancelled (30)")
    group.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} cannot be resolved: {exc.strerror}") from exc
    family, _, _, _, address = infos[0]
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP. Without it, Nagle
    # held each response's last write for the client's delayed ACK: 40-44 ms per request on a kept-alive
    # connection (routers and Prometheus keep theirs), against 0.5-1 ms with it (docs/fleet.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or stop the "
                         "process that holds it") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time, in clock ticks since boot), or None
    where that is not readable. The startup report's clock starts there, before Python and torch load."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat; fields[0] is field 3
    except (OSError, ValueError, IndexError):
        return None


def startup_timeline(marks: dict) -> str:
    """'ready X s after the process started: ...' from process ages at listening, load start and ready."""
    if marks.get("ready") is None:
        return "timeline unavailable (no /proc here)"
    model = marks["model_s"]
    engine = marks["ready"] - marks["load_start"] - model
    return (f"ready {marks['ready']:.1f} s after the process started: imports and setup {marks['listening']:.1f} s "
            f"until listening, model {model:.1f} s, engine (KV pool, decode step) {engine:.1f} s")


def describe_seal_cost(ms: dict[str, float]) -> str:
    """'0.21 ms a page, 1.9 ms a group' from summaries.seal_cost: what a seal adds between decode steps."""
    parts = [f"{ms['page']:.2f} ms a page (its records in every layer and KV head)"]
    if "group" in ms:
        parts.append(f"{ms['group']:.2f} ms a group of pages (coarse records)")
    return ", ".join(parts) + ", timed on the engine thread once ready"


def report_seal_cost(pool) -> None:
    """Time a seal (summaries.seal_cost, the pool untouched) and print what it costs. Runs as the engine thread's
    first command after the server is ready, not before: timing it took 0.5-4.7 s of a warm start's 4-9 s (four
    seals of a chunk of pages; measured on this 2-core VM), and nothing needs the figure to serve. A request that
    arrives meanwhile waits for it, once, as it would behind a long prefill."""
    from oval_edge.kv.records.summaries import seal_cost

    ms = seal_cost(pool)
    if ms:
        print(f"  sealing   {describe_seal_cost(ms)}", flush=True)


def describe_capacity(pool) -> str:
    """Pages and tokens the pool holds: in memory, and (with a page store) in the store as well."""
    P = pool.page_size
    resident = f"{pool.num_pages} pages x {P} tokens = {pool.resident_tokens} tokens"
    if pool.store is None:
        return resident
    blocks = pool.store.blocks
    return (f"{resident} in memory + {blocks} pages ({blocks * P} tokens) in the page store = "
            f"{pool.capacity_tokens} tokens")


def describe_store(pool) -> str:
    """Where the page store is, what the drive read at startup, its recall frames, and what it adds."""
    from oval_edge.units import format_bytes

    tier = pool.store
    speed = tier.store.read_throughput
    read = "not measured" if speed is None or speed == float("inf") else f"{format_bytes(speed)}/s"
    return (f"{tier.store.describe()}; read {read}; {tier.recall_pages} recall frames per layer; resident "
            f"{pool.resident_tokens} tokens + stored up to {tier.blocks * pool.page_size} tokens")


def startup_report(engine, spec, url: str, api_key: bool, marks: dict | None = None, webui: bool = False) -> str:
    from oval_edge.kernels.cpu import describe_kernels
    from oval_edge.units import format_bytes

    from oval_edge.runtime.model.loader import describe
    from oval_edge.runtime.model.projections import describe_4bit_path

    four_bit = describe_4bit_path(engine.loaded.model)
    pool = engine.pool
    sizing = pool.sizing.explain() if pool.sizing is not None else f"{pool.num_pages} pages fixed by num_pages"
    lines = [
        "oval-edge serve: ready",
        f"  model     {describe(engine.loaded)}",
        f"  weights   {engine.loaded.weight_bytes} bytes",
        f"  KV pool   {sizing}",
        f"  capacity  {describe_capacity(pool)}; limit per request {engine.token_limit()} tokens (prompt + max_tokens)",
        f"  KV dtype  {pool.geometry.kv_label}: {pool.geometry.kv_bytes_per_token} bytes per token"
        + (f", {pool.int8.staging.slots} staging pages for sealing" if pool.int8 is not None else ""),
        *([f"  KV store  {describe_store(pool)}"] if pool.store is not None else []),
        *([f"  layers    {pool.geometry.describe_layers()}"] if pool.geometry.ring_layers or pool.geometry.shared
          else []),
        *([f"  states    {pool.geometry.states.describe()} x ({pool.states.slots} running + "
           f"{pool.states.snapshots} prefix-cache snapshots) = "
           f"{format_bytes(pool.states.nbytes())} (taken before the pages; OVAL scores the "
           f"{pool.geometry.paged_layers} attention layers)"] if pool.states is not None else []),
        f"  engine    {describe_spec(spec)}",
        f"  kernels   {describe_kernels(engine.loaded.device)}",
        *([f"  matmuls   {four_bit}"] if four_bit is not None else []),
        f"  decode    {engine.describe_decode_step()}",
        f"  step ops  {engine.describe_step_ops()}",
        f"  serving   {url}/v1 (OpenAI API), {url}/health, {url}/metrics, {url}/docs"
        + (f", {url}/ (chat page)" if webui else "")
        + ("; API key required" if api_key else ""),
    ]
    if marks is not None:
        lines.append(f"  startup   {startup_timeline(marks)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    bound_shape_caches()  # first: before anything in this process multiplies on the CPU
    from oval_edge.runtime.model.origin.source import resolve_model

    from .app import ServerSettings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = engine_spec(args)
    source = resolve_model(spec.model)  # a missing or wrong file fails here, naming its path, before binding
    host = args.host or spec.server.get("host", "127.0.0.1")
    port = args.port if args.port is not None else spec.server.get("port", 8000)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port!r} is out of range: allowed 0..65535")
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace {args.shutdown_grace} must be >= 0 seconds")
    settings = ServerSettings(model_name=source.name, api_key=args.api_key or None,
                              max_body_bytes=args.max_body, max_tokens_limit=args.max_tokens_limit,
                              metrics_public=args.metrics_public, webui=args.webui,
                              strict_requests=args.strict_requests)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}"
    outcome = {"rc": 0}
    server_ref: dict = {}
    marks = {"listening": process_age_s()}

    def load_engine():
        marks["load_start"] = process_age_s()
        # What the imports made lives as long as the process: frozen, the garbage collections that follow (the
        # loader's after the weights, and every full one while serving) skip its ~200k objects (0.08 s -> 0.01 s
        # for the loader's, measured).
        gc.freeze()
        engine = spec.load()
        marks["model_s"] = engine.loaded.load_seconds
        return engine

    def on_ready(engine) -> None:
        marks["ready"] = process_age_s()
        if None in (marks["listening"], marks["load_start"]):
            marks["ready"] = None
        print(startup_report(engine, spec, url, bool(settings.api_key), marks, settings.webui), flush=True)
        app.state.server.loop.post(lambda: report_seal_cost(engine.pool))

    def on_load_error(message: str) -> None:
        print(f"oval-edge serve: error: {message}", file=sys.stderr, flush=True)
        outcome["rc"] = 1
        server_ref["server"].should_exit = True

    app = create_app(settings, load_engine, on_ready=on_ready, on_load_error=on_load_error)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=10,
                            lifespan="on")
    server = DrainingServer(config, app.state.server, args.shutdown_grace)
    server_ref["server"] = server
    print(f"oval-edge serve: listening on {url} (loading {source.path}, quant {spec.quant}, device {spec.device}; "
          "GET /health answers 503 until the model is ready)", flush=True)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    return outcome["rc"]


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of stopping, and which then exits 0.

    (uvicorn re-raises a captured signal after its shutdown, which would end the process with -SIGTERM; this
    handler records none, so a drained server returns normally.) A second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, state, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.draining:  # second signal: stop now (uvicorn cancels what still runs)
            self.force_exit = True
            self.should_exit = True
            return
        self.draining = True
        self.state.begin_drain()
        log.info("signal %s: draining (no new requests; up to %.0f s for running ones)", sig, self.grace_s)
        threading.Thread(target=self._drain, name="oval-edge-drain", daemon=True).start()

    def _drain(self) -> None:
        if self.state.loop is not None:
            cancelled = self.state.loop.drain(self.grace_s)
            if cancelled:
                log.info("drain: cancelled %d request(s) still running after %.0f s", cancelled, self.grace_s)
        self.should_exit = True
