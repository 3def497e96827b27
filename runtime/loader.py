"""Load a Llama-family model with 4-bit weights and its own tokenizer and chat template."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

import torch

from .model_source import ModelSource, check_architecture, resolve_model
from .embeddings import StoredEmbedding, StoredHead, store_embeddings
from .quantize import QUANT_TYPES, quantize_decoder_linears, weight_bytes


@dataclass
class LoadedModel:
    model: torch.nn.Module  # transformers *ForCausalLM, decoder projections swapped for 4-bit layers
    tokenizer: object
    source: ModelSource
    quant: str
    device: torch.device
    dtype: torch.dtype  # activations / embeddings / norms
    weight_bytes: int
    load_seconds: float

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


def compute_dtype_for(device: torch.device) -> torch.dtype:
    # CPU: fp32 activations (bf16 is only fast inside bitsandbytes' fused 4-bit kernel); CUDA: fp16 (Orin has
    # no fast bf16 path on every module, fp16 is what its tensor cores and flash-attn take).
    return torch.float32 if device.type == "cpu" else torch.float16


def load_model(model: str | None = "default", quant: str = "nf4", device: str | None = "auto",
               fuse: bool = True) -> LoadedModel:
    """Load, quantize and report. Raises ValueError naming the path for a missing/broken/unsupported model.

    fuse=True fuses q/k/v and gate/up into single 4-bit layers for the runtime's forward (same numbers, fewer
    kernel calls); fuse=False keeps transformers' module layout so its own forward/generate still runs.
    """
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant={quant!r} is unknown; allowed: {', '.join(QUANT_TYPES)}")
    start = time.perf_counter()
    source = resolve_model(model)
    dev = pick_device(device)
    dtype = compute_dtype_for(dev)
    # 4-bit: read the checkpoint in 16 bits (half the load-time peak of fp32); the 4-bit codes lose more anyway.
    load_dtype = dtype if quant == "none" else (torch.bfloat16 if dev.type == "cpu" else torch.float16)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source.directory, **kwargs)
    except Exception as exc:  # transformers raises many types for a broken file; name the path
        raise ValueError(f"model {source.path}: cannot read its configuration ({type(exc).__name__}: {exc})") from exc
    check_architecture(getattr(config, "model_type", None), source.path)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        # Attention limited to the last `window` tokens is not implemented: refuse rather than attend wrongly.
        raise ValueError(
            f"model {source.path}: sliding-window attention ({window} tokens) is not supported; use a model "
            "without it (e.g. Mistral v0.2+, where sliding_window is null)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
        hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=load_dtype, **kwargs)
    except Exception as exc:
        raise ValueError(f"model {source.path}: cannot load its weights ({type(exc).__name__}: {exc})") from exc
    hf_model.eval().requires_grad_(False)
    if quant != "none":
        quantize_decoder_linears(hf_model, quant, compute_dtype=load_dtype, device=dev, fuse=fuse)
        store_embeddings(hf_model, storage=load_dtype, activations=dtype)
        gc.collect()
    # Norms (and, unquantized, everything) in the activation dtype; 4-bit layers and stored embeddings keep theirs.
    kept = (StoredEmbedding, StoredHead, *_linear4bit_types(quant))
    for module in hf_model.modules():
        if isinstance(module, kept):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype.is_floating_point and (param.dtype != dtype or param.device != dev):
                param.data = param.data.to(device=dev, dtype=dtype)
    for module in hf_model.modules():  # rotary inv_freq and other buffers follow the weights
        for name, buf in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, buf.to(dev), persistent=name not in module._non_persistent_buffers_set)
    return_freed_memory()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    logging.getLogger(__name__).info("loaded %s (%s) on %s", source.path, quant, dev)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=source,
        quant=quant,
        device=dev,
        dtype=dtype,
        weight_bytes=weight_bytes(hf_model),
        load_seconds=time.perf_counter() - start,
    )


def _linear4bit_types(quant: str) -> tuple:
    if quant == "none":
        return ()
    import bitsandbytes as bnb

    return (bnb.nn.Linear4bit,)


def return_freed_memory() -> None:
    """Give the heap freed after loading (full-precision tensors, GGUF buffers) back to the OS.

    glibc keeps freed arenas mapped; without this the process's RSS stays at the load-time peak, which would
    both waste a Jetson's shared memory and inflate the reserve the pool is sized against.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


def describe(loaded: LoadedModel) -> str:
    c = loaded.config
    return (
        f"{loaded.name} ({c.model_type}, {c.num_hidden_layers} layers, {c.num_attention_heads} q / "
        f"{c.num_key_value_heads} kv heads) from {os.path.basename(loaded.source.path)}, quant {loaded.quant}, "
        f"weights {loaded.weight_bytes / 2**20:.1f} MiB on {loaded.device}, loaded in {loaded.load_seconds:.1f} s"
    )
