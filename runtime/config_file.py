"""The TOML file `oval-edge plan --write-config` writes and `oval-edge serve --config` reads.

    [model]   path = "/abs/model.gguf" | "/abs/hf-folder" | "default";  quant = "auto" | "gguf" | "int4" | "nf4" | "fp4" | "none";
              chat_template = "chatml-tools" (shipped) | "template.jinja" (relative to the config file's folder)
    [oval]    OvalConfig fields (page_size, top_k, sink_pages, window_min, window_max, dense_layers, scorer, rank,
              eta, kv_dtype, reuse_tau, reuse_slots, window_module) - validated by OvalConfig itself; a relative
              window_module path is taken relative to the config file's folder
    [server]  memory_budget (bytes or "1.5GiB": what the process may use for weights + workspace + KV pool),
              the EngineConfig settings max_batch, max_queue, prefill_chunk, max_step_tokens, max_model_len (or its alias
              max_context, as runtime/server/options.py reads it), attention, oval_from (decode steps whose longest
              row is shorter run the dense step: `oval-edge profile` measures it; 0 = OVAL at every length),
              decode_step, and device ("auto", "cpu", "cuda", "cuda:N"), host, port; the page store's kv_store (a
              path on the NVMe drive, relative to the config file's folder), kv_store_size (bytes or "16GiB"),
              pool_tokens, recall_pages, kv_store_checksums; state_snapshots (a hybrid model's state copies or a
              sliding-window model's ring windows, for prefix caching)
    [plan]    what the planner predicted (numbers and strings; informational, serve does not act on it)

`oval_config(sections)` gives the OvalConfig with the budget merged in, `engine_kwargs(sections)` the
EngineConfig keyword arguments. A relative model path is taken relative to the config file's folder. Errors
name the file, the section and the key, and say what is allowed. Imports neither torch nor the tools.
"""

from __future__ import annotations

import os
import sys

from oval_edge.config import OvalConfig
from oval_edge.runtime.model.origin.source import QUANT_TYPES
from oval_edge.runtime.model.tokenizer import SHIPPED_TEMPLATES
from oval_edge.units import parse_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SECTIONS = ("model", "oval", "server", "plan")


def _int(lo: int, hi: int):
    def check(value, where: str):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{where}={value!r} must be an integer in [{lo}, {hi}]")
        return value
    return check


def _size(value, where: str):
    return parse_bytes(value, where)


def _str(value, where: str):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}={value!r} must be a non-empty string")
    return value


def _device(value, where: str):
    value = _str(value, where)
    if value not in ("auto", "cpu", "cuda") and not (value.startswith("cuda:") and value[5:].isdigit()):
        raise ValueError(f"{where}={value!r} is not a device; use auto, cpu, cuda or cuda:N")
    return value


def _quant(value, where: str):
    if value not in QUANT_TYPES:
        raise ValueError(f"{where}={value!r} is unknown; allowed: {', '.join(QUANT_TYPES)}")
    return value


def _choice(*allowed: str):
    def check(value, where: str):
        if value not in allowed:
            raise ValueError(f"{where}={value!r} is unknown; allowed: {', '.join(allowed)}")
        return value

    return check


def _bool(value, where: str):
    if not isinstance(value, bool):
        raise ValueError(f"{where}={value!r} must be true or false")
    return value


_attention = _choice("oval", "dense")
_decode_step = _choice("static", "compiled", "eager")
MODEL_KEYS = {"path": _str, "quant": _quant, "dtype": _choice("auto", "float32", "bfloat16", "float16"),
              "chat_template": _str}
# Ranges as runtime/engine/setup.EngineConfig checks them, so a file that loads also builds an engine.
ENGINE_KEYS = {
    "max_batch": _int(1, 1024), "max_queue": _int(0, 1_000_000), "prefill_chunk": _int(16, 65536),
    "max_step_tokens": _int(2, 1 << 20),
    "max_model_len": _int(2, 1 << 24), "attention": _attention, "oval_from": _int(0, 1 << 24),
    "decode_step": _decode_step,
    "cuda_graphs": _bool, "prefix_cache": _bool,
    # The page store on disk (oval_edge/kv/store/): its path (on the NVMe), size, and the in-memory pool's cap.
    "pool_tokens": _int(1, 1 << 30), "kv_store": _str, "kv_store_size": _size, "recall_pages": _int(1, 1 << 20),
    "kv_store_checksums": _bool, "state_snapshots": _int(0, 1 << 16),
}
# runtime/server/options.py reads max_context (cap on prompt + max_tokens) and falls back to max_model_len.
ENGINE_ALIASES = {"max_context": "max_model_len"}
SERVER_KEYS = {"memory_budget": _size, "device": _device, "host": _str, "port": _int(1, 65535),
               "max_context": _int(2, 1 << 24), **ENGINE_KEYS}


def validate_sections(data: dict, source: str = "config") -> dict:
    """Check and normalise a parsed config (sizes -> ints, OvalConfig validated). Returns a new dict."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be a table of sections {list(SECTIONS)}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{source}: unknown section(s) {unknown}; allowed: {list(SECTIONS)}")
    out: dict = {}
    for section in SECTIONS:
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [{section}] must be a table, got {type(table).__name__}")
        if section == "oval":
            try:
                out[section] = OvalConfig.from_dict(dict(table)).to_dict()
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: [oval] {exc}") from exc
            continue
        if section == "plan":
            bad = [k for k, v in table.items() if not isinstance(v, (int, float, str, bool))]
            if bad:
                raise ValueError(f"{source}: [plan] key(s) {bad} must be numbers or strings")
            out[section] = dict(table)
            continue
        keys = MODEL_KEYS if section == "model" else SERVER_KEYS
        extra = sorted(set(table) - set(keys))
        if extra:
            raise ValueError(f"{source}: [{section}] unknown key(s) {extra}; allowed: {sorted(keys)}")
        out[section] = {k: keys[k](v, f"[{section}] {k}") for k, v in table.items()}
    server = out["server"]
    if "max_context" in server and "max_model_len" in server and server["max_context"] != server["max_model_len"]:
        raise ValueError(f"{source}: [server] max_context={server['max_context']} and max_model_len="
                         f"{server['max_model_len']} disagree; keep one")
    return out


def oval_config(sections: dict) -> OvalConfig:
    """[oval] as an OvalConfig, with [server] memory_budget as its memory_budget."""
    values = dict(sections.get("oval", {}))
    server_budget = sections.get("server", {}).get("memory_budget")
    if server_budget is not None:
        if values.get("memory_budget") not in (None, server_budget):
            raise ValueError(f"memory_budget is set twice with different values: [oval] {values['memory_budget']} "
                             f"and [server] {server_budget}; keep one")
        values["memory_budget"] = server_budget
    return OvalConfig.from_dict(values)


def engine_kwargs(sections: dict) -> dict:
    """The [server] keys that are EngineConfig fields (max_context given as max_model_len)."""
    server = sections.get("server", {})
    out = {k: v for k, v in server.items() if k in ENGINE_KEYS}
    for alias, key in ENGINE_ALIASES.items():
        if alias in server:
            out.setdefault(key, server[alias])
    return out


def load_config_file(path: str) -> dict:
    """Read and validate a config TOML -> {"model": {...}, "oval": {...}, "server": {...}, "plan": {...}}."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from exc
    sections = validate_sections(data, f"config file {path}")
    model_path = sections["model"].get("path")
    if model_path and model_path != "default" and not os.path.isabs(os.path.expanduser(model_path)):
        sections["model"]["path"] = os.path.normpath(os.path.join(os.path.dirname(path), model_path))
    module = sections["oval"].get("window_module")  # like the model path: relative to the config file's folder
    if module and not os.path.isabs(os.path.expanduser(module)):
        sections["oval"]["window_module"] = os.path.normpath(os.path.join(os.path.dirname(path), module))
    store = sections["server"].get("kv_store")  # like the model path: relative to the config file's folder
    if store and not os.path.isabs(os.path.expanduser(store)):
        sections["server"]["kv_store"] = os.path.normpath(os.path.join(os.path.dirname(path), store))
    template = sections["model"].get("chat_template")  # a shipped template's name, or a file like the model path
    if template and template not in SHIPPED_TEMPLATES and not os.path.isabs(os.path.expanduser(template)):
        sections["model"]["chat_template"] = os.path.normpath(os.path.join(os.path.dirname(path), template))
    return sections


def write_config_file(path: str, sections: dict, writer: str = "oval-edge plan") -> str:
    """Validate, then write `sections` as TOML (tomli-w, imported here); `writer` names the command in the header.
    Returns the absolute path."""
    import tomli_w

    path = os.path.abspath(os.path.expanduser(path))
    clean = validate_sections(sections, f"config for {path}")
    text = tomli_w.dumps({k: v for k, v in clean.items() if v})
    header = f"# Written by `{writer}`; read by `oval-edge serve --config`. Sizes are bytes.\n"
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(header + text)
    except OSError as exc:
        raise ValueError(f"cannot write config file {path}: {exc.strerror or exc}") from exc
    return path
