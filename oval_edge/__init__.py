"""OVAL: output-aware local page selection over a KV page pool allocated once from a memory budget."""

from .config import OvalConfig
from .geometry import KVGeometry, PoolSizing, size_pool
from .pool import PagePool, StepIndex
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
]
__version__ = "0.1.0"
