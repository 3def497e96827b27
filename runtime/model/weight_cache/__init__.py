"""A cache of the loaded (quantized) decoder: quantize once, memory-map the result at every later start.

entry.py: the key, the entry's place and the load-or-build policy; tree.py: the module tree as JSON and storages (no
pickle); file_format.py: the safetensors file, its checksums and the memory map.
"""

from .entry import DISABLE_ENV, WeightCacheEntry, cache_enabled, load_or_build

__all__ = ["DISABLE_ENV", "WeightCacheEntry", "cache_enabled", "load_or_build"]
