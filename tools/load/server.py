"""`--serve auto`: start `oval-edge serve` on a free loopback port, wait until /health says ready, stop it with
SIGTERM afterwards (the server's graceful path: stop admitting, finish or cancel streams, exit 0)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

from oval_edge.tools.timing import Stopwatch

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel says is free now (bind to 0). Another process could take it before the server binds;
    the server then fails to start and the error names the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, headers: dict | None = None, alive=lambda: True) -> float:
    """Poll GET /health until 200 (503 means still loading). Returns the seconds waited; ValueError on timeout."""
    import httpx

    waited = Stopwatch()
    last = "no answer yet"
    while waited.seconds < timeout_s:
        if not alive():
            raise ValueError(f"the server at {url} exited before it became ready ({last})")
        try:
            response = httpx.get(f"{url}/health", headers=headers or {}, timeout=5.0)
            if response.status_code == 200:
                return waited.seconds
            last = f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise ValueError(f"the server at {url} was not ready after {timeout_s:.0f} s ({last}); raise --time-limit")


class AutoServer:
    """One `oval-edge serve` child process on 127.0.0.1:<free port>."""

    def __init__(self, serve_args: str = "", api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.command = [sys.executable, "-m", "oval_edge.cli", "serve", "--host", LOOPBACK,
                        "--port", str(self.port), *shlex.split(serve_args)]
        if api_key:
            self.command += ["--api-key", api_key]
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="oval-load-"), "serve.log")
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def start(self) -> "AutoServer":
        env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float, headers: dict | None = None) -> float:
        try:
            return wait_healthy(self.url, timeout_s, headers, self.alive)
        except ValueError as exc:
            raise ValueError(f"{exc}\nserver command: {shlex.join(self.command)}\nits log ends with:\n"
                             f"{self.log_tail()}") from exc

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`. Returns the server's exit code (0 for a clean shutdown)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.exit_code = self.process.returncode
        return self.exit_code

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()[-chars:]
        except OSError:
            return "(no log)"
