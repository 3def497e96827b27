"""One cache entry per model source and load settings: its key, where it lives, and loading / storing it.

An entry is `<cache root>/weights/<slot>/weights.safetensors` (file_format.py). The slot is a hash of what picks a
different model (the source's real path, quant, device type, activation and storage dtypes, the 4-bit and
embedding layouts): one file per such choice, replaced when it goes stale, so old copies of a multi-GB model do not
pile up. The full key, stored in the file and compared field by field at load, adds what makes the bytes differ:
the source files' sizes and mtimes, the format version, torch's and bitsandbytes' versions and a hash of the model
code. Any difference, a missing, truncated or corrupt file, or a tree that cannot be rebuilt means "not trusted":
the loader quantizes from the source and replaces the entry, and the log says why.

A new entry is written beside its final name and renamed over it (os.replace), so a reader sees the old file or the
new one, never a partial one; a read-only or full cache folder only means an uncached load (and a log line).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

from oval_edge.cache_dir import cache_root

from .file_format import CorruptEntry, map_storages, read_manifest, write_file
from .tree import TreeReader, TreeWriter, UncacheableTree

FORMAT_VERSION = 1  # bump when the file or tree layout changes
FILE_NAME = "weights.safetensors"
DISABLE_ENV = "OVAL_EDGE_WEIGHT_CACHE"  # "0" (or off/false/no): load from the source every time
_MODEL_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # runtime/model: what builds the bytes

log = logging.getLogger(__name__)


def cache_enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def model_code_hash(root: str = _MODEL_CODE) -> str:
    """SHA-256 over the model code's .py files (runtime/model/**): a code change that may change the bytes of a
    build invalidates every entry, even in an editable install whose version never moves (~40 files, ~2 ms)."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def source_files(path: str) -> list[list]:
    """[name, size, mtime_ns] of the file, or of a folder's config.json and weight files: what the build reads."""
    if os.path.isfile(path):
        stat = os.stat(path)
        return [[os.path.basename(path), stat.st_size, stat.st_mtime_ns]]
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith((".safetensors", ".bin", ".json")))
    return [[n, os.stat(os.path.join(path, n)).st_size, os.stat(os.path.join(path, n)).st_mtime_ns] for n in names]


@dataclass(frozen=True)
class WeightCacheEntry:
    """The cache entry for one load: `key` is what the file must carry to be trusted."""

    path: str  # the entry's file
    key: dict  # JSON-able: compared field by field with the file's

    @classmethod
    def for_load(cls, source_path: str, quant: str, device: torch.device, dtype: torch.dtype,
                 storage: torch.dtype, layout: dict, root: str | None = None) -> "WeightCacheEntry":
        """layout: how the build lays the bytes out on this host (loader: 4-bit packed for the CPU kernel, int8
        embedding table), which a cached tree must match to equal a fresh build."""
        real = os.path.realpath(source_path)
        choice = {"source": real, "quant": quant, "device": device.type, "dtype": str(dtype), "storage": str(storage),
                  **{k: str(v) for k, v in sorted(layout.items())}}
        slot = hashlib.sha256(repr(sorted(choice.items())).encode()).hexdigest()[:24]
        key = {**choice, "files": source_files(real), "format": FORMAT_VERSION, "torch": torch.__version__,
               "bitsandbytes": _version("bitsandbytes"), "model_code": model_code_hash()}
        return cls(os.path.join(root or cache_root(), "weights", slot, FILE_NAME), key)

    def load(self, device: torch.device, threads: int | None = None) -> tuple[nn.Module | None, str]:
        """(the rebuilt decoder, "") or (None, why it was not used)."""
        if not os.path.isfile(self.path):
            return None, "no entry yet"
        try:
            manifest, header, data_start = read_manifest(self.path)
            stale = _differences(manifest.get("key"), self.key)
            if stale:
                return None, f"stale ({stale})"
            storages = map_storages(self.path, manifest, header, data_start, threads or torch.get_num_threads())
            if device.type != "cpu":  # each storage back where it was built (a CUDA build may keep some on the CPU)
                kinds = [s["device"] for s in manifest["tree"]["storages"]]
                storages = [s.to(device) if kind != "cpu" else s for s, kind in zip(storages, kinds)]
            model = TreeReader(manifest["tree"], storages).build()
        except (CorruptEntry, UncacheableTree) as exc:
            return None, str(exc)
        except (OSError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:  # a damaged description
            return None, f"corrupt ({type(exc).__name__}: {exc})"
        return model, ""

    def store(self, model: nn.Module) -> str:
        """Write the entry for `model` (just built); "" when published, else why not (nothing is left behind)."""
        try:
            writer = TreeWriter()
            tree = writer.describe(model)
        except UncacheableTree as exc:
            return f"the model cannot be cached: {exc}"
        folder = os.path.dirname(self.path)
        staging = None
        try:
            os.makedirs(folder, exist_ok=True)
            handle, staging = tempfile.mkstemp(prefix=".staging-", suffix=".safetensors", dir=folder)
            os.close(handle)
            write_file(staging, writer.storages, {"key": self.key, "tree": tree})
            os.replace(staging, self.path)
            staging = None
        except OSError as exc:  # read-only folder, disk full, quota
            return f"cannot write {folder} ({exc.strerror or exc})"
        finally:
            if staging is not None:
                try:
                    os.unlink(staging)
                except OSError:
                    pass
        return ""


def _differences(cached, current: dict) -> str:
    if not isinstance(cached, dict):
        return "no key in the file"
    changed = [f"{k}: cached {cached.get(k)!r}, now {v!r}" for k, v in current.items() if cached.get(k) != v]
    return "; ".join(changed)


def load_or_build(entry: WeightCacheEntry | None, device: torch.device, build) -> tuple[nn.Module, str]:
    """The decoder from `entry` if it is trusted, else `build()` (then cached): (decoder, a line for the report)."""
    if entry is None:
        start = time.perf_counter()
        model = build()
        return model, f"quantized from the source in {time.perf_counter() - start:.1f} s (weight cache off)"
    start = time.perf_counter()
    model, why = entry.load(device)
    if model is not None:
        return model, f"from the weight cache {entry.path} in {time.perf_counter() - start:.2f} s"
    log.info("weight cache: %s: %s; quantizing from the source", entry.path, why)
    start = time.perf_counter()
    model = build()
    built = time.perf_counter() - start
    start = time.perf_counter()
    failed = entry.store(model)
    if failed:
        log.info("weight cache: not cached: %s", failed)
        return model, f"quantized from the source in {built:.1f} s (not cached: {failed})"
    return model, f"quantized from the source in {built:.1f} s, cached to {entry.path} in " \
                  f"{time.perf_counter() - start:.1f} s"
