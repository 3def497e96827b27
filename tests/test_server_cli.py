"""The real `oval-edge serve` process: flags and --config, the startup report, the API key, and SIGTERM (stop
admitting, let the running stream finish, exit 0). One model load, in the child process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_server_support import get, post

pytestmark = pytest.mark.slow
SERVE = [sys.executable, "-m", "oval_edge.cli", "serve"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=300)


def test_help_lists_the_flags():
    result = _run("--help")
    assert result.returncode == 0
    for flag in ("--model", "--quant", "--device", "--memory-budget", "--page-size", "--top-k", "--config", "--host",
                 "--port", "--api-key", "--max-batch", "--max-queue", "--threads"):
        assert flag in result.stdout


@pytest.mark.parametrize("args,words", [
    (("--page-size", "24"), "page_size=24 is not a power of two"),
    (("--model", "/nonexistent/model.gguf"), "/nonexistent/model.gguf"),
    (("--max-batch", "0"), "max_batch=0"),
    (("--config", "/nonexistent/serve.toml"), "/nonexistent/serve.toml"),
    (("--threads", "0"), "--threads 0 must be >= 1"),
])
def test_bad_flags_fail_fast_naming_the_value(args, words):
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_a_model_that_fails_to_load_exits_one_naming_its_path(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))  # passes the magic check at startup, fails in the loader
    child = subprocess.run([*SERVE, "--model", str(broken), "--port", "0"], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 1, child.stdout + child.stderr
    assert "listening on" in child.stdout  # the port was up (and /health said 503) while it tried
    assert f"oval-edge serve: error: model {broken}" in child.stderr


class _Output:
    """Collects a child's stdout lines in a thread so the test can wait for one without blocking."""

    def __init__(self, stream):
        self.lines: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r} in {timeout} s; output so far: {self.lines}")


def test_serve_with_config_then_sigterm_drains_and_exits_zero(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('[model]\npath = "default"\n[oval]\npage_size = 16\ntop_k = 2\n'
                      '[server]\nmax_batch = 2\nmax_context = 256\ndevice = "cpu"\n')
    child = subprocess.Popen(
        [*SERVE, "--config", str(config), "--port", "0", "--api-key", "k3y", "--max-queue", "4",
         "--shutdown-grace", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OVAL_EDGE_API_KEY": ""},
    )
    try:
        out = _Output(child.stdout)
        url = out.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", 120).group(1)
        auth = {"Authorization": "Bearer k3y"}
        deadline = time.monotonic() + 600
        while get(url + "/health", timeout=10).status_code != 200:
            assert child.poll() is None and time.monotonic() < deadline, out.lines
            time.sleep(0.1)
        out.wait_for(r"^oval-edge serve: ready", 10)
        assert out.wait_for(r"KV pool\s+pages = floor\(.*\) = (\d+)", 5)
        assert out.wait_for(r"weights\s+\d+ bytes", 5)
        assert out.wait_for(r"capacity\s+\d+ pages x 16 tokens", 5)  # page_size from the config file
        assert out.wait_for(r"limit per request 256 tokens", 5)  # max_context from the config file
        assert post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 401

        # Long enough to still be running when the refused request arrives 0.5 s after SIGTERM (24 tokens no
        # longer were once decode got faster: the server had drained and closed before that request).
        body = {"prompt": "Once upon a time", "max_tokens": 160, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=300) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            child.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # let the signal land in the child
            refused = post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(first[6:])] + [json.loads(r) for r in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert child.wait(timeout=120) == 0
        assert any(re.search(r"cmpl-\w+ completions prompt=\d+ completion=160 .* outcome=length", line)
                   for line in out.lines), out.lines
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_threads_flag_sets_torch_threads():
    import argparse

    import torch

    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    before = torch.get_num_threads()
    try:
        engine_spec(parser.parse_args(["--threads", "1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_chat_template_flag_and_config_key(tmp_path):
    import argparse

    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    spec = engine_spec(parser.parse_args(["--chat-template", "chatml-tools"]))
    assert spec.chat_template == "chatml-tools" and "<tool_call>" in spec.chat_template_text
    assert engine_spec(parser.parse_args([])).chat_template_text is None  # the model's own
    with pytest.raises(ValueError, match="--chat-template .*nope.jinja"):
        engine_spec(parser.parse_args(["--chat-template", str(tmp_path / "nope.jinja")]))
    # [model] chat_template: a file is taken relative to the config file's folder
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}")
    (tmp_path / "c.toml").write_text('[model]\nchat_template = "mine.jinja"\n')
    spec = engine_spec(parser.parse_args(["--config", str(tmp_path / "c.toml")]))
    assert spec.chat_template == str(tmp_path / "mine.jinja") and "{{ tools }}" in spec.chat_template_text


def test_the_listening_socket_gives_accepted_connections_tcp_nodelay():
    """Kept-alive clients (routers, Prometheus) wait ~40 ms per request when Nagle is on: asyncio turns it off
    only for sockets whose proto is TCP, so the socket serve binds must say so (checked here, not timed)."""
    import asyncio
    import socket

    from oval_edge.runtime.server.serve import _bind

    listener = _bind("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
