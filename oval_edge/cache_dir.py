"""Where oval-edge keeps what it derives once and reuses (converted GGUF metadata, compiled CPU kernels).

$OVAL_EDGE_CACHE, else $XDG_CACHE_HOME/oval-edge, else ~/.cache/oval-edge.
"""

from __future__ import annotations

import os

CACHE_ENV = "OVAL_EDGE_CACHE"


def cache_root() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "oval-edge")
