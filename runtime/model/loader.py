"""Load a Llama-family model with 4-bit weights and its own tokenizer and chat template."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .config import DecoderConfig
from .decoder_build import build_decoder
from .gguf_metadata import PROJECTION_TYPES_KEY, cached_metadata_folder, gguf_config_values
from .heap import compact_heap_while_loading, return_freed_memory
from .embeddings import int8_head_applies, int8_table_applies
from .quantize import import_bitsandbytes, weight_bytes
from .origin.source import GROUPED_QUANTS, ModelSource, resolve_model, resolve_quant
from .tokenizer import load_tokenizer
from .weight_cache import WeightCacheEntry, cache_enabled, load_or_build
from .weight_stream import GGUFWeights, SafetensorsWeights


@dataclass
class LoadedModel:
    model: torch.nn.Module  # runtime.model.decoder.DecoderModel: fused 4-bit (or full-precision) projections
    # The tokenizer, or a Future of it while it still loads (load_model(..., tokenizer_in_background=True)); read it
    # as `tokenizer`, which waits for that load and raises its ValueError.
    tokenizer_source: object
    source: ModelSource
    quant: str
    device: torch.device
    dtype: torch.dtype  # activations / embeddings / norms
    weight_bytes: int
    load_seconds: float
    precision_note: str = ""  # a GGUF's stored tensor types and what re-quantizing them costs (requantization_note)
    weights_origin: str = ""  # where the weights came from: the weight cache (its path) or quantized, and how long

    @property
    def tokenizer(self):
        if isinstance(self.tokenizer_source, Future):
            self.tokenizer_source = self.tokenizer_source.result()
        return self.tokenizer_source

    @property
    def config(self):
        return self.model.config

    @property
    def name(self) -> str:
        return self.source.name


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not supported; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for CUDA, but torch sees no CUDA device; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use cpu, cuda, cuda:N or auto")
    return dev


ACTIVATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype_for(device: torch.device, requested: str = "auto",
                      capability: tuple[int, int] | None = None) -> torch.dtype:
    """Activations, embeddings and norms: `requested` ('auto', 'float32', 'bfloat16', 'float16') on `device`.

    auto: fp32 on a CPU (bf16 is only fast inside bitsandbytes' fused 4-bit kernel there); on CUDA bf16 from compute
    capability 8.0 (Ampere; Orin is 8.7: its tensor cores take bf16 at fp16's rate, and bf16 cannot overflow where
    fp16's 65504 ceiling clips large activations), fp16 below. capability: (major, minor), read from the device when
    None. A CPU takes bfloat16 only when asked: the C GEMV and attention kernels read fp32, so bf16 runs torch's bf16
    matmuls there (~5x slower per decode step), which is how a CPU computes what CUDA's bf16 step will (docs/bf16.md).
    float16 is refused on a CPU: no target runs it where bf16 is available, and torch's CPU fp16 matmuls are slow.
    """
    if requested not in ("auto", *ACTIVATION_DTYPES):
        raise ValueError(f"dtype={requested!r} is unknown; allowed: auto, {', '.join(ACTIVATION_DTYPES)}")
    if device.type == "cpu":
        if requested == "float16":
            raise ValueError("dtype='float16' is not supported on the CPU; use --dtype auto or float32 (fast), or "
                             "bfloat16 (what CUDA runs on compute capability 8.0+, slower here)")
        return torch.bfloat16 if requested == "bfloat16" else torch.float32
    if requested != "auto":
        return ACTIVATION_DTYPES[requested]
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def load_model(model: str | None = "default", quant: str = "auto", device: str | None = "auto",
               dtype: str = "auto", weight_cache: bool | None = None,
               tokenizer_in_background: bool = False) -> LoadedModel:
    """Load, quantize and report. Raises ValueError naming the path for a missing/broken/unsupported model.

    Weights stream from the file one layer at a time into the runtime's own decoder (runtime/model/decoder.py):
    q/k/v and gate/up are fused into single 4-bit layers (same numbers, fewer kernel calls), and transformers'
    model classes are never imported (see runtime/model/config.py for why). The built decoder is kept in the weight
    cache (runtime/model/weight_cache/) and memory-mapped from there at the next load with the same source and
    settings; weight_cache: False bypasses it, None follows $OVAL_EDGE_WEIGHT_CACHE (on unless "0").

    tokenizer_in_background: the tokenizer loads on a thread of its own and `loaded.tokenizer` waits for it. Why:
    it is mostly importing transformers (0.7-0.9 s of Python holding the GIL, measured), while the weights and then
    the engine's KV pool (hundreds of MB first touched by torch, GIL released) take as long or longer; the engine
    reads the tokenizer only after its pool is built (Engine.load), so a warm start overlaps the two.
    """
    start = time.perf_counter()
    source = resolve_model(model)
    quant = resolve_quant(quant, source)
    dev = pick_device(device)
    dtype = compute_dtype_for(dev, dtype)
    # 4-bit: quantize from 16 bits and keep the embedding in 16 bits (the 4-bit codes lose more anyway); on CUDA the
    # 16 bits of the activations, so nothing is converted per step.
    storage = dtype if quant == "none" else (torch.bfloat16 if dev.type == "cpu" or dtype == torch.float32 else dtype)
    metadata = cached_metadata_folder(source.path) if source.gguf_file else None
    values = decoder_config_values(source, metadata)
    config = DecoderConfig.from_dict(values, source.path)
    if tokenizer_in_background:
        loading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oval-edge-tokenizer")
        tokenizer = loading.submit(load_tokenizer, source, metadata)
        loading.shutdown(wait=False)  # the one job still runs; the thread ends with it
    else:
        tokenizer = load_tokenizer(source, metadata)

    def build():
        weights = _open_weights(source, config)
        try:
            with compact_heap_while_loading():
                return build_decoder(weights, config, quant, dev, dtype, storage)
        except ValueError:
            raise
        except Exception as exc:  # a tensor of the wrong shape or a short file: name the path
            raise ValueError(f"model {source.path}: cannot load its weights ({type(exc).__name__}: {exc})") from exc
        finally:
            weights.close()

    entry = None
    if weight_cache if weight_cache is not None else cache_enabled():
        layout = build_layout(config, quant, dev, dtype)
        entry = WeightCacheEntry.for_load(source.path, quant, dev, dtype, storage, layout)
    decoder, origin = load_or_build(entry, dev, build)
    return_freed_memory()
    logging.getLogger(__name__).info("loaded %s (%s) on %s: weights %s", source.path, quant, dev, origin)
    return LoadedModel(
        model=decoder,
        tokenizer_source=tokenizer,
        source=source,
        quant=quant,
        device=dev,
        dtype=dtype,
        weight_bytes=weight_bytes(decoder),
        load_seconds=time.perf_counter() - start,
        weights_origin=origin,
        precision_note=requantization_note(values, quant),
    )


def build_layout(config: DecoderConfig, quant: str, device: torch.device, dtype: torch.dtype) -> dict:
    """How build_decoder lays out the bytes on this host, beyond the load's settings: whether bitsandbytes repacks
    4-bit weights for its AVX512-BF16 kernel or, without it, their absmax is un-nested for our own GEMV (native
    kernels present; quantize.pack_for_cpu), and whether the embedding/head become an int8 table (native kernels
    present; on CUDA the head only with its Triton kernel). A cached tree is only used where a fresh build would lay
    them out the same."""
    if quant == "none":
        return {"cpu_packed_4bit": False, "int8_table": False}
    head = int8_head_applies(config.hidden_size, device, dtype)
    if quant in GROUPED_QUANTS:  # one layout on every host; the int8 table depends on the kernels being there
        return {"grouped": True, "int8_table": int8_table_applies(config.hidden_size, device), "int8_head": head}
    import_bitsandbytes()  # lean, before anything imports it (quantize.py says why)
    from bitsandbytes.functional import has_avx512bf16

    from oval_edge.kernels.cpu import cpu_kernels

    packed = device.type == "cpu" and bool(has_avx512bf16())
    return {"cpu_packed_4bit": packed,
            "cpu_unnested_4bit": device.type == "cpu" and not packed and cpu_kernels() is not None,
            "int8_table": int8_table_applies(config.hidden_size, device), "int8_head": head}


def read_decoder_config(source: ModelSource, metadata: str | None = None) -> DecoderConfig:
    """The decoder's shape from the GGUF header (or its converted copy in `metadata`, runtime/model/gguf_metadata.py)
    or config.json."""
    return DecoderConfig.from_dict(decoder_config_values(source, metadata), source.path)


def decoder_config_values(source: ModelSource, metadata: str | None = None) -> dict:
    """The transformers-named config keys read_decoder_config parses (a GGUF's also name its tensor types)."""
    if metadata is not None:
        with open(os.path.join(metadata, "config.json"), encoding="utf-8") as handle:
            values = json.load(handle)
    elif source.gguf_file:
        values = gguf_config_values(source)
    else:
        with open(os.path.join(source.directory, "config.json"), encoding="utf-8") as handle:
            values = json.load(handle)  # resolve_model already checked that it parses
    return values


# GGML types holding more than 4 bits a weight: re-quantizing them to 4 bits loses precision the file had
FINER_THAN_4_BITS = ("Q8_0", "Q8_1", "Q8_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "F16", "BF16", "F32")


def requantization_note(values: dict, quant: str) -> str:
    """What loading a GGUF's projections as `quant` does to their precision (for the startup report), or ''."""
    from .grouped.gguf_blocks import DECODERS, EXACT_TYPES

    types = values.get(PROJECTION_TYPES_KEY) or {}
    if quant == "none" or not types:
        return ""
    stored = ", ".join(f"{name} x{count}" for name, count in sorted(types.items()))
    if quant == "gguf":
        exact = sorted(t for t in types if t in EXACT_TYPES)
        product = sorted(t for t in types if t in DECODERS and t not in EXACT_TYPES)
        other = sorted(t for t in types if t not in DECODERS)
        parts = [f"{'/'.join(exact)} served as stored (exact)"] if exact else []
        parts += [f"{'/'.join(product)} served as stored, sub-block scales rounded to fp16"] if product else []
        parts += [f"{'/'.join(other)} have no grouped form: re-quantized to 8-bit codes per 32"] if other else []
        return f"projections stored as {stored}; " + "; ".join(parts)
    finer = [name for name in types if name in FINER_THAN_4_BITS]
    if finer:
        return (f"projections stored as {stored}; re-quantized to {quant}, the {'/'.join(sorted(finer))} ones lose "
                f"precision the file has (--quant gguf serves the file's own blocks)")
    return (f"projections stored as {stored}; dequantized and re-quantized to {quant} (a second rounding; --quant gguf "
            "serves the file's own blocks)")


def _open_weights(source: ModelSource, config: DecoderConfig):
    try:
        if source.gguf_file:
            return GGUFWeights(source.path, config.model_type, config.num_attention_heads, config.num_key_value_heads)
        return SafetensorsWeights(source.path)
    except ValueError:
        raise
    except Exception as exc:  # gguf / safetensors raise many types for a broken file
        raise ValueError(f"model {source.path}: cannot read its weights ({type(exc).__name__}: {exc})") from exc


def describe(loaded: LoadedModel) -> str:
    c = loaded.config
    return (
        f"{loaded.name} ({c.model_type}, {c.num_hidden_layers} layers, {c.num_attention_heads} q / "
        f"{c.num_key_value_heads} kv heads) from {os.path.basename(loaded.source.path)}, quant {loaded.quant}, "
        f"weights {loaded.weight_bytes / 2**20:.1f} MiB on {loaded.device}, activations "
        f"{str(loaded.dtype).removeprefix('torch.')}, loaded in {loaded.load_seconds:.1f} s"
        + (f" (weights {loaded.weights_origin})" if loaded.weights_origin else "")
        + (f"; {loaded.precision_note}" if loaded.precision_note else "")
    )
