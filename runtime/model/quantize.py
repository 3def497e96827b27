"""bitsandbytes 4-bit layers: importing bitsandbytes lean, building one layer, packing layers for the CPU
kernel, and counting the bytes a model holds.

Embeddings, norms and the output head stay in 16/32 bits, as transformers' bitsandbytes integration keeps them:
the head is tied to the embedding in small models, and quantizing it costs the most accuracy.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

BLOCKSIZE = 64


def import_bitsandbytes():
    """bitsandbytes, imported so that neither importing nor calling it pulls in TorchDynamo.

    At import it wraps a few pure-PyTorch fallbacks in torch.compile, and torch.library wraps every kernel it
    registers in torch._disable_dynamo, whose first call imports TorchDynamo, sympy and torch.distributed: +75 MB
    resident (10% of an 8 GB Orin Nano's serving budget) for machinery this runtime never runs (nothing here is
    compiled; runtime processes also set TORCHDYNAMO_DISABLE). While bitsandbytes imports, both are stood in for
    by the identity: the same eager functions are registered and called. If bitsandbytes was already imported
    (a user's process), it is left as it is.

    On a CPU with AVX512-BF16 its CPU backend also asks the Hugging Face hub, at import, for an optional GEMM kernel
    (`kernels.get_kernel`): a network round trip at every start (0.6 s here), a remote kernel only if the hub vouches
    for its publisher, and otherwise a "Failed to load CPU gemm_4bit_forward ... Set trust_remote_code=True"
    warning that asks the user for nothing they need to do. The `kernels` package is hidden while bitsandbytes
    imports, so it falls back to its own library (the path the startup report's `matmuls` line names,
    projections.PackedCpu4bit), and that one notice is dropped (HubKernelNotice).
    """
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    saved = torch.compile, torch._disable_dynamo
    hub = sys.modules.get("kernels", _ABSENT)

    def identity(fn=None, *args, **kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compile, torch._disable_dynamo = identity, identity
    sys.modules["kernels"] = None  # `from kernels import get_kernel` raises ImportError, which bitsandbytes expects
    logging.getLogger(HUB_KERNEL_LOGGER).addFilter(HubKernelNotice())
    try:
        import bitsandbytes
    finally:
        torch.compile, torch._disable_dynamo = saved
        if hub is _ABSENT:
            sys.modules.pop("kernels", None)
        else:
            sys.modules["kernels"] = hub
    return bitsandbytes


_ABSENT = object()  # marks "no `kernels` entry in sys.modules" apart from a None entry
HUB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"


class HubKernelNotice(logging.Filter):
    """Drops bitsandbytes' warning that its optional hub kernel did not load (import_bitsandbytes says why); its
    other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


def has_fused_gemm() -> bool:
    """Whether bitsandbytes has its fused 4-bit GEMM (gemm_4bit, from 0.50), which reads a double-quantized absmax
    inside the kernel. Before it, matmul_4bit multiplies one row through gemv_4bit and more through dequantize_4bit,
    and both rebuild a double-quantized absmax first, at every call."""
    import_bitsandbytes()
    return hasattr(torch.ops.bitsandbytes, "gemm_4bit")


def unnest_at_load(device: torch.device, fused_gemm: bool | None = None) -> bool:
    """Whether 4-bit weights built for `device` keep their absmax un-nested (fp32): on CUDA without the fused GEMM
    (bitsandbytes 0.45-0.49, what older JetPack images carry). There every projection call, one per decode row
    (projections.Chunked4bit), would first rebuild the fp32 absmax from its 8-bit codes (dequantize_blockwise, then
    + offset: two more launches, 1/64 byte per weight read and 4/64 written and read back); stored as fp32 the GEMV
    reads it directly, for +3/64 byte per weight held (quantize.weight_bytes counts what is held)."""
    return device.type == "cuda" and not (has_fused_gemm() if fused_gemm is None else fused_gemm)


def linear4bit(weight: torch.Tensor, bias: torch.Tensor | None, quant: str, compute_dtype: torch.dtype,
               device: torch.device) -> nn.Module:
    """weight [out, in] -> bnb.nn.Linear4bit on `device` (double-quantized absmax, blocks of 64; un-nested to fp32
    on CUDA where bitsandbytes has no fused GEMM, unnest_at_load)."""
    bnb = import_bitsandbytes()
    out_features, in_features = weight.shape
    q = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                          compress_statistics=True,  # double quantization: absmax stored in 8 bits
                          quant_type=quant, device="meta")
    q.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type=quant,
                                 blocksize=BLOCKSIZE).to(device)
    if bias is not None:
        q.bias = nn.Parameter(bias.to(device=device, dtype=compute_dtype), requires_grad=False)
    if unnest_at_load(device):
        unnest_absmax(q.weight.quant_state)
    return q


@torch.no_grad()  # not inference_mode: bitsandbytes then fails on layers with a bias (Qwen2's q/k/v)
def pack_for_cpu(model: nn.Module) -> None:
    """Put each 4-bit weight in the layout its CPU decode kernel reads, now rather than in the first request.

    On CPUs with AVX512-BF16 bitsandbytes' first inference call repacks the weight (and un-nests absmax to bf16) for
    its fused 4-bit GEMV. Elsewhere our own GEMV (runtime/model/projections.Unfused4bit) reads bitsandbytes' layout
    as it is with the absmax un-nested to fp32 (unnest_absmax). Doing either at load makes the reported weight bytes
    the bytes really held.
    """
    from oval_edge.kernels.cpu import cpu_kernels

    bnb = import_bitsandbytes()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.eval()
            module(torch.zeros(1, module.in_features))
            state = module.weight.quant_state
            if not getattr(state, "packing_format_for_cpu", False) and cpu_kernels() is not None:
                unnest_absmax(state)


def unnest_absmax(state) -> None:
    """Replace a double-quantized absmax (uint8 codes + their own blockwise state) by the fp32 values bitsandbytes'
    dequantize_4bit computes from it at every call: identical dequantized weights, +3/64 byte per weight."""
    if not state.nested:
        return
    functional = import_bitsandbytes().functional
    state.absmax = (functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    state.nested, state.state2, state.offset = False, None, None


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
