"""A GGUF's configuration and tokenizer as a small Hugging Face-style folder, converted once per file.

Why: read from the GGUF in Python, they cost the serving process memory it never gets back. transformers' GGUF
header reader (for the config) and its GGUF -> tokenizers converter each build Python objects for every vocabulary
entry (SmolLM2: 49k tokens and 48k merges); they are freed, but the heap they fragmented stays resident for as
long as the process serves (~8 MB measured on SmolLM2). So the conversion runs once, in a child process, into a
cache folder (config.json and the tokenizer's own files, written by `save_pretrained`), and every load reads that
folder. The folder is keyed by the file's real path, size, mtime, the transformers version and METADATA_FORMAT, and
appears by an atomic rename, so a folder that exists is complete. If it cannot be written or the child fails, the loader parses
the GGUF in-process as before (and that path reports what is wrong with the file).

Cache location: $OVAL_EDGE_CACHE, else $XDG_CACHE_HOME/oval-edge, else ~/.cache/oval-edge.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile

from oval_edge.cache_dir import cache_root

from .families.gemma4_gguf import GEMMA4_GGUF_ARCHS, ROPE_FREQS, config_values as gemma4_config_values
from .families.hybrid_gguf import HYBRID_GGUF_ARCHS, config_values as hybrid_config_values
from .origin.source import ModelSource

CONVERT_TIMEOUT_S = 600  # a large vocabulary converts in well under a minute; a hung child must not hang startup
CONFIG_NAME = "config.json"
# Bumped when what the conversion writes changes (2: the projections' tensor types), so older folders are redone.
METADATA_FORMAT = 2

log = logging.getLogger(__name__)


def metadata_folder_for(gguf_path: str) -> str:
    """Where this GGUF's converted metadata lives (it may not exist yet)."""
    stat = os.stat(gguf_path)
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    key = (f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|transformers {transformers_version}"
           f"|format {METADATA_FORMAT}")
    return os.path.join(cache_root(), "gguf-metadata", hashlib.sha256(key.encode()).hexdigest()[:24])


def cached_metadata_folder(gguf_path: str) -> str | None:
    """The folder with this GGUF's config.json and tokenizer, converting it in a child process if needed.

    None when it is not there and could not be made (read-only cache, a file the converter rejects): the caller
    then reads the GGUF itself.
    """
    folder = metadata_folder_for(gguf_path)
    if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        return folder
    command = [sys.executable, "-m", __name__, gguf_path, folder]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("could not convert the metadata of %s (%s); reading it in-process", gguf_path, exc)
        return None
    if done.returncode != 0 or not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        log.info("could not convert the metadata of %s (%s); reading it in-process", gguf_path, tail[0])
        return None
    return folder


def write_metadata_folder(gguf_path: str, folder: str) -> None:
    """Convert (the child's job): parse the GGUF's config and tokenizer and publish them at `folder` atomically."""
    from .origin.source import resolve_model
    from .tokenizer import load_tokenizer

    source = resolve_model(gguf_path)
    values = gguf_config_values(source)
    tokenizer = load_tokenizer(source)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(folder))
    try:
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, CONFIG_NAME), "w", encoding="utf-8") as handle:
            json.dump(values, handle, indent=1)
        try:
            os.replace(staging, folder)
        except OSError:
            if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):  # not another process's complete copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Architectures whose header transformers' GGUF reader refuses, read here from llama.cpp's generic keys, with what
# llama.cpp fixes in code (SmolLM3: n_no_rope_layer_step = 4, every 4th layer without RoPE).
OWN_HEADER_READER = {"smollm3": {"no_rope_layer_interval": 4}}


def gguf_config_values(source: ModelSource) -> dict:
    """The GGUF header as Hugging Face config keys, read by transformers' GGUF reader (or, for the architectures it
    refuses, by _own_header_values)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        values = _own_header_values(source.path)
        if values is None:
            values = load_gguf_checkpoint(source.path, return_tensors=False)["config"]
        values.update(_fields_transformers_drops(source.path, values))
    except Exception as exc:  # a truncated or foreign file raises anything from struct to numpy errors
        raise ValueError(f"model {source.path}: cannot read its configuration ({type(exc).__name__}: {exc})") from exc
    values[PROJECTION_TYPES_KEY] = _projection_types(source.path)
    if values.get("model_type") == "phi3":
        try:
            values.update(_phi3_values(source.path, values))
        except Exception as exc:
            raise ValueError(f"model {source.path}: cannot read its phi3 rope settings ({type(exc).__name__}: "
                             f"{exc})") from exc
    return values


PROJECTION_TYPES_KEY = "oval_edge_gguf_projection_types"  # in the converted config.json: {GGML type: tensors}


def _projection_types(path: str) -> dict[str, int]:
    """How the file stores the decoder layers' projection matrices: {GGML type name: tensors} (the loader's startup
    report says what re-quantizing them to 4 bits costs)."""
    from gguf import GGUFReader

    from .grouped.gguf_blocks import is_stored_projection

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        if is_stored_projection(tensor):
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def header_scalar(fields, key: str):
    """One scalar of a GGUF header (a number, or a string), None when absent."""
    field = fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode() if part.dtype == "uint8" and len(part) > 1 else part[0].item()


def _own_header_values(path: str) -> dict | None:
    """Config keys of a GGUF whose architecture is in OWN_HEADER_READER, HYBRID_GGUF_ARCHS or GEMMA4_GGUF_ARCHS,
    else None (transformers reads it)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields
    arch = header_scalar(fields, "general.architecture")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # transformers' order
    if arch in HYBRID_GGUF_ARCHS:  # Qwen3.5 / LFM2: their own keys (families/hybrid_gguf.py)
        values = hybrid_config_values(arch, lambda key: header_scalar(fields, f"{arch}.{key}"),
                                      lambda key: header_array(fields, f"{arch}.{key}"), shapes)
    elif arch in GEMMA4_GGUF_ARCHS:  # Gemma 4's text decoder (families/gemma4_gguf.py)
        rope_freqs = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
        values = gemma4_config_values(lambda key: header_scalar(fields, f"{arch}.{key}"),
                                      lambda key: header_array(fields, f"{arch}.{key}"), shapes, rope_freqs)
    elif arch in OWN_HEADER_READER:
        keys = dict(num_hidden_layers="block_count", max_position_embeddings="context_length",
                    hidden_size="embedding_length", intermediate_size="feed_forward_length",
                    num_attention_heads="attention.head_count", num_key_value_heads="attention.head_count_kv",
                    rope_theta="rope.freq_base", rms_norm_eps="attention.layer_norm_rms_epsilon")
        values = {name: header_scalar(fields, f"{arch}.{key}") for name, key in keys.items()}
        values.update(model_type=arch, **OWN_HEADER_READER[arch])
    else:
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    values.update(vocab_size=len(tokens.data) if tokens is not None else None,
                  tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
                  bos_token_id=header_scalar(fields, "tokenizer.ggml.bos_token_id"),
                  eos_token_id=header_scalar(fields, "tokenizer.ggml.eos_token_id"))
    return {name: value for name, value in values.items() if value is not None}


def header_array(fields, key: str) -> list | None:
    """One array of a GGUF header (numbers), None when absent or not an array (LFM2's per-layer head_count_kv)."""
    field = fields.get(key)
    if field is None or len(field.types) < 2:
        return None
    return [field.parts[index][0].item() for index in field.data]


def _fields_transformers_drops(path: str, values: dict) -> dict:
    """Config keys transformers' GGUF reader leaves out, read from the header or fixed as llama.cpp fixes them.

    - `{arch}.attention.key_length`: the head dimension where it is not hidden / heads (Qwen3: 128 at any width).
    - Gemma 2/3 (llama.cpp's llama-model.cpp hard-codes what its header does not carry): attention scaled by
      head_dim ** -0.5 (hidden / heads for the 27B models); Gemma 2's soft-caps from its header; Gemma 3's full layer
      every 6th, sliding layers rotating with base 10000, the full layers' rope scaling from
      `gemma3.rope.scaling.type` / `.factor`.
    """
    from gguf import GGUFReader

    kind = values.get("model_type")
    arch = "gemma3" if kind == "gemma3_text" else kind
    fields = GGUFReader(path).fields

    def scalar(key: str):
        return header_scalar(fields, f"{arch}.{key}")

    extra = {}
    head_dim = scalar("attention.key_length")
    if head_dim:
        extra["head_dim"] = int(head_dim)
    if kind in ("gemma2", "gemma3_text"):
        layers, heads = int(values["num_hidden_layers"]), int(values["num_attention_heads"])
        big = layers == (46 if kind == "gemma2" else 62)  # llama.cpp's LLM_TYPE_27B for each
        extra["query_pre_attn_scalar"] = values["hidden_size"] // heads if big else int(
            head_dim or values.get("head_dim") or 256)
    if kind == "gemma2":  # soft-caps from the header (llama.cpp writes both)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if scalar(key) is not None:
                extra[key] = float(scalar(key))
    if kind == "gemma3_text":
        extra.update(sliding_window_pattern=6, rope_local_base_freq=10000.0)
        if scalar("rope.scaling.type") == "linear" and scalar("rope.scaling.factor"):
            extra["rope_scaling"] = {"rope_type": "linear", "factor": float(scalar("rope.scaling.factor"))}
    return extra


def _phi3_values(path: str, values: dict) -> dict:
    """What transformers' GGUF reader drops for llama.cpp's phi3 (it maps neither the rope keys nor the window):
    partial_rotary_factor from `phi3.rope.dimension_count` (Phi-4-mini rotates 96 of 128 dims), the sliding window
    (0 when the model has none; Phi-3-mini-4k's 2047 is refused by DecoderConfig), and LongRoPE's factor sets,
    stored as the tensors rope_factors_short/long, with `phi3.rope.scaling.original_context_length` and
    `.attn_factor` (the cos/sin scaling llama.cpp's converter computed)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def scalar(key: str):
        return header_scalar(reader.fields, f"phi3.{key}")

    extra: dict = {}
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rotary = scalar("rope.dimension_count")
    if rotary and rotary != head_dim:
        extra["partial_rotary_factor"] = rotary / head_dim
    window = scalar("attention.sliding_window")
    extra["sliding_window"] = int(window) if window else None
    original = scalar("rope.scaling.original_context_length")
    if original:
        extra["original_max_position_embeddings"] = int(original)
    factors = {t.name: [float(f) for f in t.data.reshape(-1)] for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if factors:
        if len(factors) != 2 or not original:
            raise ValueError("LongRoPE needs rope_factors_long, rope_factors_short and "
                             "phi3.rope.scaling.original_context_length together")
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                                 "short_factor": factors["rope_factors_short.weight"],
                                 "original_max_position_embeddings": int(original)}
        attention_factor = scalar("rope.scaling.attn_factor")
        if attention_factor is not None:
            extra["rope_scaling"]["attention_factor"] = float(attention_factor)
    return extra


if __name__ == "__main__":
    write_metadata_folder(sys.argv[1], sys.argv[2])
