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


# Projections that read the same input and are fused into one 4-bit matmul (one kernel call instead of 3 / 2).
FUSED_GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def quantize_decoder_linears(model: nn.Module, quant: str, compute_dtype: torch.dtype, device: torch.device,
                             fuse: bool = False) -> int:
    """Replace every decoder projection with bnb.nn.Linear4bit on `device`; returns how many 4-bit layers exist.

    Each full-precision weight is dropped as soon as its 4-bit copy exists, so peak memory stays near one layer
    above the quantized model. fuse=True stacks q/k/v (and gate/up) row-wise before quantizing: bitsandbytes
    quantizes blocks of 64 consecutive weights and every row length here is a multiple of 64, so each row gets
    exactly the codes and scales it would get alone; the fused layer computes the same numbers with fewer calls.
    The model's own forward (transformers) then no longer runs; the runtime's forward does.
    """
    if quant not in ("nf4", "fp4"):
        raise ValueError(f"quant={quant!r} is not a 4-bit type; allowed: nf4, fp4 (or 'none' to skip quantizing)")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU backend warns about an optional hub kernel
    replaced = 0
    for layer in model.model.layers:
        if fuse:
            for parent_name, fused_name, names in FUSED_GROUPS:
                parent = getattr(layer, parent_name)
                parts = [getattr(parent, n) for n in names]
                if all(isinstance(p, nn.Linear) and p.in_features % BLOCKSIZE == 0 for p in parts):
                    weight = torch.cat([p.weight.data for p in parts])
                    bias = torch.cat([p.bias.data for p in parts]) if parts[0].bias is not None else None
                    for n in names:
                        setattr(parent, n, None)
                    del parts
                    setattr(parent, fused_name, _linear4bit(weight, bias, quant, compute_dtype, device))
                    replaced += 1
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEAR_NAMES:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    bias = linear.bias.data if linear.bias is not None else None
                    setattr(parent, name, _linear4bit(linear.weight.data, bias, quant, compute_dtype, device))
                    del linear
                    replaced += 1
    if device.type == "cpu":
        _pack_for_cpu(model)
    return replaced


def _linear4bit(weight: torch.Tensor, bias: torch.Tensor | None, quant: str, compute_dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    q = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                          compress_statistics=True,  # double quantization: absmax stored in 8 bits
                          quant_type=quant, device="meta")
    q.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type=quant,
                                 blocksize=BLOCKSIZE).to(device)
    if bias is not None:
        q.bias = nn.Parameter(bias.to(device=device, dtype=compute_dtype), requires_grad=False)
    return q


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
