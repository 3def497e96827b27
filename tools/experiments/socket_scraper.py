"""A scraper as light as a router's: its own process, one kept-alive TCP connection, raw HTTP/1.1 GETs at 20 Hz.

scrape_cost's default scraper is an httpx client in the load generator's own process; on a 2-core machine its
~1 ms of Python per request competes with the server for the cores, which a router on another host (the llm-d
endpoint picker and sglang-router are Go and Rust binaries) does not. This one spends a few tens of microseconds
per scrape: it writes a fixed request, reads the headers and Content-Length bytes, and sleeps to the next tick.

    with SocketScraper("127.0.0.1", 8000, "/metrics") as scraper:
        scraper.scrape()                  # GETs at 20 Hz from now
        scrapes = scraper.pause()         # [(began, seconds)]; began is tools/timing.clock(): CLOCK_MONOTONIC on
                                          # Linux, so the parent can compare it with its own clock
"""

from __future__ import annotations

import multiprocessing
import socket

from oval_edge.tools.timing import clock

PERIOD_S = 0.05


def _read_response(conn: socket.socket, buffer: bytes) -> bytes:
    """Reads one response (headers, then Content-Length bytes); returns what came after it. Raises on a non-200."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the scrape connection")
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    if status_line.split(b" ")[1] != b"200":
        raise RuntimeError(f"scrape answered {status_line.decode(errors='replace')}")
    length = next(int(line.split(b":", 1)[1]) for line in header_lines if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the scrape connection mid-body")
        rest += chunk
    return rest[length:]


def _connect(host: str, port: int) -> socket.socket:
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _scrape_loop(host: str, port: int, path: str, control) -> None:
    """Serves the parent's commands: "scrape" starts a stretch of 20 Hz GETs, "pause" ends it and sends back its
    [(began, seconds)], "quit" ends the process. Each stretch opens one connection and keeps it (as a router, which
    never pauses, keeps its one): between stretches the server's keep-alive timeout would close an idle one."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: */*\r\n\r\n".encode()
    _connect(host, port).close()  # the server answers: fail here, before the parent measures anything
    control.send("ready")
    while (command := control.recv()) == "scrape":
        scrapes: list[tuple[float, float]] = []
        with _connect(host, port) as conn:
            buffer, next_at = b"", clock()
            while not control.poll(max(0.0, next_at - clock())):
                began = clock()
                conn.sendall(request)
                buffer = _read_response(conn, buffer)
                scrapes.append((began, clock() - began))
                next_at += PERIOD_S  # a late scrape shortens the next wait, as Go's ticker would
        control.recv()  # "pause"
        control.send(scrapes)
    if command != "quit":
        raise RuntimeError(f"unknown command {command!r}")


class SocketScraper:
    """A child process that GETs host:port/path every 50 ms between scrape() and pause() (-> [(began, seconds)]).
    Started once, so a round's scraping does not also pay for starting an interpreter."""

    def __init__(self, host: str, port: int, path: str):
        context = multiprocessing.get_context("spawn")  # nothing of the parent (torch, an event loop) comes along
        self._control, child = context.Pipe()
        self._process = context.Process(target=_scrape_loop, args=(host, port, path, child), name="socket-scraper",
                                        daemon=True)

    def __enter__(self) -> "SocketScraper":
        self._process.start()
        if not self._control.poll(60) or self._control.recv() != "ready":
            raise RuntimeError("the socket scraper did not connect within 60 s; see its traceback")
        return self

    def scrape(self) -> None:
        self._control.send("scrape")

    def pause(self) -> list[tuple[float, float]]:
        self._control.send("pause")
        if not self._control.poll(30):
            raise RuntimeError("the socket scraper stopped answering; see its traceback")
        return self._control.recv()

    def __exit__(self, *exc) -> None:
        self._control.send("quit")
        self._process.join(timeout=30)
