"""The weight cache (runtime/model/weight_cache/): a cached load is the fresh load, bit for bit, and is never trusted
when it should not be.

A load that builds the decoder caches it; the next load with the same source and settings memory-maps it. The
rebuilt tree must have the same modules, classes, attributes, parameters, buffers and sharing as the fresh one (so a
plain attribute or module a new model family adds either round-trips or fails here), and its logits must equal the
fresh load's with torch.equal: the bundled GGUF in nf4 on the CPU, and tiny random Hugging Face folders (Qwen3:
per-head norms, untied head; SmolLM3: NoPE layers, tied) in quant none and nf4. A missing, stale (source mtime,
format version), truncated, corrupt (a flipped byte) or hostile entry is rebuilt with a log line saying why; an
unwritable cache folder means an uncached load. Every test uses its own OVAL_EDGE_CACHE under tmp, never the user's.
"""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.runtime import Engine, EngineConfig
from oval_edge.runtime.model import loader as loader_module
from oval_edge.runtime.model.loader import load_model
from oval_edge.runtime.model.weight_cache import entry as entry_module
from oval_edge.runtime.model.weight_cache.file_format import read_manifest, write_file
from oval_edge.runtime.model.weight_cache.tree import TreeWriter, UncacheableTree, resolve_class

from test_decoder_loading import save_folder
from test_families import family_config

PROMPT = list(range(100, 100 + 3 * 40, 3))  # 40 tokens: two full pages of 16 and an open one
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """One tmp cache for the module (the native kernels and GGUF metadata are built into it once)."""
    root = tmp_path_factory.mktemp("oval-edge-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OVAL_EDGE_CACHE", str(root))
        patch.delenv(entry_module.DISABLE_ENV, raising=False)
        yield root


@pytest.fixture(scope="module")
def folders(tmp_path_factory, cache_root):
    from test_family_gemma import gemma2_config, gemma3_config
    from test_family_phi3 import phi3_config

    configs = {kind: family_config(kind) for kind in ("qwen3", "smollm3")}
    # the families whose trees hold more: rings and two rotary tables (Gemma), LongRoPE and partial rotary (Phi-3)
    configs.update(gemma3=gemma3_config(), gemma2=gemma2_config(), phi3=phi3_config("phi4-mini"))
    return {kind: save_folder(tmp_path_factory.mktemp(kind), config) for kind, config in configs.items()}


def logits_of(loaded) -> torch.Tensor:
    """Prefill PROMPT, then DECODE_STEPS greedy steps: logits [1 + DECODE_STEPS, vocab]."""
    engine = Engine(loaded, OvalConfig(page_size=16, kv_dtype="float32"), EngineConfig(num_pages=16))
    pool = engine.pool
    assert pool.allocate("r", len(PROMPT) + DECODE_STEPS + 1) is not None
    step = pool.prepare(["r"], [len(PROMPT)])
    logits, _ = engine.runner.forward(step, torch.tensor(PROMPT), decode=False)
    pool.commit(step)
    rows = [logits[0]]
    for _ in range(DECODE_STEPS):
        step = pool.prepare(["r"], [1])
        logits, _ = engine.runner.forward(step, rows[-1].argmax().view(1), decode=True)
        pool.commit(step)
        rows.append(logits[0])
    pool.free("r")
    return torch.stack(rows)


def assert_same_tree(fresh: torch.nn.Module, cached: torch.nn.Module) -> None:
    """Same module names and classes, parameters and buffers (bit for bit, same dtypes, shapes and strides), and the
    same recorded description: every attribute, bitsandbytes' quant states, the int8 tables and what is shared."""
    assert [(n, type(m)) for n, m in fresh.named_modules()] == [(n, type(m)) for n, m in cached.named_modules()]
    for get in (lambda m: m.named_parameters(remove_duplicate=False), lambda m: m.named_buffers(remove_duplicate=False)):
        a, b = list(get(fresh)), list(get(cached))
        assert [(n, type(t), t.dtype, t.shape, t.stride()) for n, t in a] == \
               [(n, type(t), t.dtype, t.shape, t.stride()) for n, t in b]
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for (_, x), (_, y) in zip(a, b))
    fresh_tree, cached_tree = TreeWriter().describe(fresh), TreeWriter().describe(cached)
    assert fresh_tree == cached_tree
    assert any(o["class"].endswith("DecoderConfig") or "config" in o.get("attrs", {}) for o in fresh_tree["objects"])


def test_bundled_gguf_nf4_cached_load_equals_the_fresh_load(cache_root, caplog):
    caplog.set_level(logging.INFO)
    fresh = load_model("default", quant="nf4", device="cpu")
    assert "cached to" in fresh.weights_origin, fresh.weights_origin
    cached = load_model("default", quant="nf4", device="cpu")
    assert cached.weights_origin.startswith("from the weight cache"), cached.weights_origin
    assert str(cache_root) in cached.weights_origin and "weights from the weight cache" in \
        loader_module.describe(cached)
    assert cached.weight_bytes == fresh.weight_bytes
    assert_same_tree(fresh.model, cached.model)
    assert torch.equal(logits_of(fresh), logits_of(cached))
    assert any("no entry yet" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("quant", ["none", "nf4"])
@pytest.mark.parametrize("kind", ["qwen3", "smollm3", "gemma3", "gemma2", "phi3"])
def test_tiny_folder_cached_load_equals_the_fresh_load(cache_root, folders, kind, quant):
    uncached = load_model(folders[kind], quant=quant, device="cpu", weight_cache=False)
    assert "weight cache off" in uncached.weights_origin
    first = load_model(folders[kind], quant=quant, device="cpu")
    cached = load_model(folders[kind], quant=quant, device="cpu")
    assert cached.weights_origin.startswith("from the weight cache"), cached.weights_origin
    assert_same_tree(uncached.model, cached.model)
    reference = logits_of(uncached)
    assert torch.equal(reference, logits_of(first)) and torch.equal(reference, logits_of(cached))


def entry_path(folder: str, quant: str = "none") -> str:
    loaded = load_model(folder, quant=quant, device="cpu")
    path = loaded.weights_origin.split("cached to ")[-1].split(" in ")[0].split("weight cache ")[-1]
    assert os.path.isfile(path), loaded.weights_origin
    return path


def reload_says(folder: str, caplog, quant: str = "none") -> str:
    """Load again; assert it rebuilt and re-cached; return the log line that says why."""
    caplog.clear()
    caplog.set_level(logging.INFO, logger=entry_module.__name__)
    loaded = load_model(folder, quant=quant, device="cpu")
    assert "cached to" in loaded.weights_origin, loaded.weights_origin
    assert load_model(folder, quant=quant, device="cpu").weights_origin.startswith("from the weight cache")
    return " | ".join(r.getMessage() for r in caplog.records)


@pytest.fixture
def own_folder(tmp_path, cache_root):
    """A tiny model of this test's own (its cache entry is this test's to damage)."""
    return save_folder(tmp_path / "model", family_config("smollm3"))


def test_a_changed_source_mtime_is_stale(own_folder, caplog):
    entry_path(own_folder)
    weights = os.path.join(own_folder, "model.safetensors")
    stat = os.stat(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    said = reload_says(own_folder, caplog)
    assert "stale" in said and "files" in said and str(stat.st_mtime_ns) in said


def test_another_format_version_is_stale(own_folder, caplog, monkeypatch):
    entry_path(own_folder)
    monkeypatch.setattr(entry_module, "FORMAT_VERSION", entry_module.FORMAT_VERSION + 1)
    assert "stale (format: cached 1, now 2)" in reload_says(own_folder, caplog)


def test_a_flipped_byte_is_caught_by_its_checksum(own_folder, caplog):
    path = entry_path(own_folder)
    _, header, data_start = read_manifest(path)
    start, stop = header["s0"]["data_offsets"]
    with open(path, "r+b") as handle:
        handle.seek(data_start + (start + stop) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert "fails its CRC32" in reload_says(own_folder, caplog)


def test_a_damaged_header_and_a_truncated_file_are_rebuilt(own_folder, caplog):
    path = entry_path(own_folder)
    with open(path, "r+b") as handle:
        handle.seek(12)
        handle.write(b"\xff\xfe")
    assert "corrupt header" in reload_says(own_folder, caplog)
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size - 100)
    assert "truncated" in reload_says(own_folder, caplog)


def test_a_hostile_class_name_is_refused_not_imported(own_folder, caplog):
    path = entry_path(own_folder)
    for name in ("builtins:eval", "os:system", "subprocess:Popen", "torch.nn.modules.module:Module.__init__"):
        with pytest.raises(UncacheableTree, match="allowlist"):
            resolve_class(name)
    manifest, _, _ = read_manifest(path)
    loaded = load_model(own_folder, quant="none", device="cpu", weight_cache=False)  # not a map of the file rewritten
    writer = TreeWriter()
    writer.describe(loaded.model)
    manifest["tree"]["objects"][0]["class"] = "subprocess:Popen"
    write_file(path, writer.storages, {"key": manifest["key"], "tree": manifest["tree"]})
    assert "not in the weight cache's allowlist" in reload_says(own_folder, caplog)


def test_an_unwritable_or_full_cache_means_an_uncached_load(tmp_path, folders, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=entry_module.__name__)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("OVAL_EDGE_CACHE", str(blocker / "cache"))  # root ignores chmod; a file in the way does not
    loaded = load_model(folders["qwen3"], quant="none", device="cpu")
    assert "not cached: cannot write" in loaded.weights_origin
    assert any("not cached" in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("OVAL_EDGE_CACHE", str(tmp_path / "full"))

    def disk_full(path, storages, manifest):
        with open(path, "wb") as handle:
            handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(entry_module, "write_file", disk_full)
    loaded = load_model(folders["qwen3"], quant="none", device="cpu")
    assert "No space left on device" in loaded.weights_origin
    leftovers = [f for _, _, files in os.walk(tmp_path / "full" / "weights") for f in files]
    assert leftovers == []  # the partial staging file is removed


def test_an_attribute_the_cache_cannot_record_fails_loudly(cache_root, folders):
    loaded = load_model(folders["qwen3"], quant="none", device="cpu", weight_cache=False)
    loaded.model.model.layers[1].self_attn.window = object()  # what a new family might add, of an unknown type
    with pytest.raises(UncacheableTree, match=r"model\.model\.layers\.1\.self_attn\.window"):
        TreeWriter().describe(loaded.model)


def test_the_entry_is_a_plain_safetensors_file(cache_root, folders):
    from safetensors import safe_open

    path = entry_path(folders["smollm3"], quant="nf4")
    manifest, _, data_start = read_manifest(path)
    assert data_start % 4096 == 0
    with safe_open(path, framework="pt") as handle:
        assert "manifest" in handle.metadata()
        assert sorted(handle.keys()) == sorted(f"s{i}" for i in range(len(manifest["tree"]["storages"])))


def test_the_serve_flag_turns_the_cache_off_and_the_report_times_the_start(monkeypatch):
    import argparse

    from oval_edge.runtime.model.weight_cache import cache_enabled
    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec
    from oval_edge.runtime.server.serve import process_age_s, startup_timeline

    monkeypatch.delenv(entry_module.DISABLE_ENV, raising=False)  # restored after the test, whatever engine_spec sets
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine_spec(parser.parse_args(["--no-weight-cache"]))
    assert not cache_enabled()
    engine_spec(parser.parse_args(["--weight-cache"]))
    assert cache_enabled()
    age = process_age_s()
    assert age is None or age > 0
    line = startup_timeline({"listening": 2.0, "load_start": 2.1, "model_s": 1.5, "ready": 4.2})
    assert line == ("ready 4.2 s after the process started: imports and setup 2.0 s until listening, model 1.5 s, "
                    "engine (KV pool, decode step) 0.6 s")
