"""OVAL: output-aware local page selection over a KV page pool allocated once from a memory budget."""

from .config import OvalConfig
from .geometry import KVGeometry
from .pool_sizing import PoolSizing, size_pool
from .units import format_bytes, parse_bytes

__all__ = [
    "OvalConfig",
    "KVGeometry",
    "PoolSizing",
    "size_pool",
    "PagePool",
    "StepIndex",
    "parse_bytes",
    "format_bytes",
    "apply_oval_to_model",
    "remove_oval",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # PagePool / StepIndex need torch; import them on first use so torch-free users of oval_edge (the planner,
    # oval_edge.jetson, the config readers) do not pay for torch at import time.
    if name == "PagePool":
        from .kv.pool import PagePool

        return PagePool
    if name == "StepIndex":
        from .kv.step_index import StepIndex

        return StepIndex
    if name in ("apply_oval_to_model", "remove_oval"):  # imports transformers: only when asked for
        from .hf import integration

        return getattr(integration, name)
    raise AttributeError(f"module 'oval_edge' has no attribute {name!r}")
