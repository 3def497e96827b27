"""Swap the decoder's nn.Linear layers for bitsandbytes 4-bit ones, one layer at a time (one weight copy).

Embeddings, norms and the output head stay in the compute dtype, as transformers' bitsandbytes integration
keeps them: the head is tied to the embedding in small models, and quantizing it costs the most accuracy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

QUANT_TYPES = ("nf4", "fp4", "none")
# Projections inside each decoder layer (Llama, Mistral, Qwen2 share these names).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCKSIZE = 64


def quantize_decoder_linears(model: nn.Module, quant: str, compute_dtype: torch.dtype, device: torch.device) -> int:
    """Replace every decoder projection with bnb.nn.Linear4bit on `device`; returns how many were replaced.

    Each full-precision weight is dropped as soon as its 4-bit copy exists, so peak memory stays near one layer
    above the quantized model.
    """
    if quant not in ("nf4", "fp4"):
        raise ValueError(f"quant={quant!r} is not a 4-bit type; allowed: nf4, fp4 (or 'none' to skip quantizing)")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU backend warns about an optional hub kernel
    import bitsandbytes as bnb

    replaced = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEAR_NAMES:
                linear = getattr(parent, name, None)
                if not isinstance(linear, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    compute_dtype=compute_dtype,
                    compress_statistics=True,  # double quantization: absmax stored in 8 bits
                    quant_type=quant,
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    linear.weight.data, requires_grad=False, compress_statistics=True, quant_type=quant,
                    blocksize=BLOCKSIZE,
                ).to(device)
                if linear.bias is not None:
                    q.bias = nn.Parameter(linear.bias.data.to(device=device, dtype=compute_dtype), requires_grad=False)
                setattr(parent, name, q)
                del linear
                replaced += 1
    if device.type == "cpu":
        _pack_for_cpu(model)
    return replaced


@torch.no_grad()  # not inference_mode: bitsandbytes then fails on layers with a bias (Qwen2's q/k/v)
def _pack_for_cpu(model: nn.Module) -> None:
    """Let bitsandbytes convert each 4-bit weight to its fused CPU layout now, not in the first request.

    On CPUs with AVX512-BF16 its first inference call repacks the weight (and un-nests absmax to bf16) for the
    fused 4-bit GEMV kernel; doing it at load makes the reported weight bytes the bytes really held.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.eval()
            module(torch.zeros(1, module.in_features))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and bitsandbytes quantization state, each storage counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p.data)
        state = getattr(p, "quant_state", None)
        if state is not None:
            add(state.absmax)
            add(state.code)
            nested = getattr(state, "state2", None)
            if getattr(state, "nested", False) and nested is not None:
                add(nested.absmax)
                add(nested.code)
                add(getattr(state, "offset", None))
    for name, b in model.named_buffers():
        if "rotary" in name:  # inv_freq: recomputable, not a weight
            continue
        add(b)
    return total
