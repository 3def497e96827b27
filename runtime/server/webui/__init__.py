"""The chat page at GET / (off with `serve --no-webui`): one static HTML file, chat.html, with its script and style
inline, no build step and nothing loaded from elsewhere (a board on a bench is often offline).

The page talks to the server through its public API only: /v1/models for the model's name, /v1/chat/completions
with `stream: true` for the answers (an abort closes the connection, so the server cancels the request and frees
its pages), /metrics for the KV pool's use. It holds no secret, so it is served without the API key; the key is
typed into the page and sent as a Bearer token with each API call.

The response carries a Content-Security-Policy that allows exactly the page's own inline script and style (by
their SHA-256, computed here from the file) and connections to this origin: nothing else can run in it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from importlib.resources import files

from starlette.responses import Response

PAGE_FILE = "chat.html"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.S)


def content_security_policy(html: str) -> str:
    """The CSP for `html`: its inline <script> and <style> blocks by hash, fetches to this origin only."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode("ascii")
        hashes[tag].append(f"'sha256-{digest}'")
    if not hashes["script"]:
        raise ValueError(f"{PAGE_FILE} has no inline <script> block; the page cannot work without one")
    script, style = " ".join(hashes["script"]), " ".join(hashes["style"]) or "'none'"
    return (f"default-src 'none'; script-src {script}; style-src {style}; connect-src 'self'; img-src data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class ChatPage:
    html: bytes
    csp: str

    @classmethod
    def load(cls) -> "ChatPage":
        """Read the page shipped with the package (package data: the wheel carries it)."""
        html = files(__package__).joinpath(PAGE_FILE).read_bytes()
        return cls(html, content_security_policy(html.decode("utf-8")))

    def response(self) -> Response:
        return Response(self.html, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": self.csp, "X-Content-Type-Options": "nosniff",
                                 "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})


def install_chat_page(app) -> None:
    """GET (and HEAD) / answer the chat page (left out of the OpenAPI schema: it is not part of the API)."""
    page = ChatPage.load()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return page.response()
