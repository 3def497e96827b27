"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub calls to list and download a model repo.

    GET  /api/models/{org}/{repo}[/revision/{rev}]   the repo's commit and files with sizes (model_info)
    HEAD /{org}/{repo}/resolve/{rev}/{path}          X-Repo-Commit, ETag, Content-Length (get_hf_file_metadata)
    GET  /{org}/{repo}/resolve/{rev}/{path}          the bytes; `Range: bytes=N-[M]` answers 206 Partial Content

Unknown repos answer 401 with X-Error-Code RepoNotFound and unknown files 404 with EntryNotFound, as the Hub does.
Every request is recorded (method, path, headers), so a test sees the Range a resumed download sent and the token.
`cut[path] = n` makes the next download GET of that file (no Range, or `bytes=N-`) send its full Content-Length
but only `n` bytes, then drop the connection (a lost network mid-file); `stall[path] = n` stops after `n` bytes
until `released` is set (a download to interrupt). Started in a thread on a free port: HF_ENDPOINT = `hub.url`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/?]+))?(?:\?.*)?$")


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class HubStandIn:
    repos: dict[str, dict[str, Path]] = field(default_factory=dict)  # repo -> {repo path: local file}
    requests: list[Request] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)  # repo path -> bytes sent before the connection drops
    stall: dict[str, int] = field(default_factory=dict)  # repo path -> bytes sent before the body stops coming
    released: threading.Event = field(default_factory=threading.Event)  # ends every stall
    url: str = ""

    def add(self, repo: str, files: dict[str, Path]) -> None:
        self.repos[repo] = {name: Path(local) for name, local in files.items()}

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()  # 40 hex digits, as a commit id is

    def gets(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)]


def _etag(path: Path) -> str:
    """The content's sha256, as the Hub's ETag of an LFS file is."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the test reads hub.requests
            pass

        def _record(self) -> None:
            hub.requests.append(Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

        def _error(self, status: int, code: str, repo: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if repo in hub.repos:
                self.send_header("X-Repo-Commit", hub.commit(repo))
            body = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._record()
            api = API.match(self.path)
            if api:
                return self._model_info(api["repo"])
            return self._resolve()

        def do_HEAD(self) -> None:
            self._record()
            self._resolve()

        def _model_info(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._error(401, "RepoNotFound")
            siblings = [{"rfilename": name, "size": local.stat().st_size} for name, local in hub.repos[repo].items()]
            body = json.dumps({"id": repo, "sha": hub.commit(repo), "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _resolve(self) -> None:
            match = RESOLVE.match(self.path.split("?")[0])
            if match is None or match["repo"] not in hub.repos:
                return self._error(401, "RepoNotFound")
            repo, name = match["repo"], match["path"]
            local = hub.repos[repo].get(name)
            if local is None:
                return self._error(404, "EntryNotFound", repo)
            size = local.stat().st_size
            start, end = 0, size - 1
            ranged = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
            if ranged:
                start, end = int(ranged[1]), min(int(ranged[2]) if ranged[2] else size - 1, size - 1)
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", hub.commit(repo))
            if not (ranged and ranged[2]):  # a header read needs no ETag: spare hashing a multi-GB test file
                self.send_header("ETag", f'"{_etag(local)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if self.command == "HEAD":
                return
            with open(local, "rb") as handle:
                handle.seek(start)
                left = end - start + 1
                whole = not ranged or not ranged[2]  # a download (from its start or resumed), not a header read
                cut = hub.cut.pop(name, None) if whole else None
                stall = hub.stall.pop(name, None) if whole else None
                while left > 0:
                    chunk = handle.read(min(left, 1 << 16, cut if cut is not None else left))
                    self.wfile.write(chunk)
                    left -= len(chunk)
                    if stall is not None:
                        stall -= len(chunk)
                        if stall <= 0:  # a download that stops making progress until the test lets it go
                            self.wfile.flush()
                            hub.released.wait(60)
                            return
                    if cut is not None:
                        cut -= len(chunk)
                        if cut <= 0:  # drop the connection mid-body, as a lost network does
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return

    return Handler


def start(hub: HubStandIn) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pull(hub: HubStandIn, home: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`oval-edge pull ARGS` in a child process with HF_ENDPOINT at the stand-in and HF_HOME at `home`."""
    return subprocess.run([sys.executable, "-m", "oval_edge.cli", "pull", *args], capture_output=True, text=True,
                          timeout=timeout, env=hub_env(hub, home, **env))


def hub_env(hub: HubStandIn, home: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**base, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
