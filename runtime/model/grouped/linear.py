"""A projection held in the grouped integer format (layout.py), and how it multiplies per device, as one
registered op.

`oval_edge::grouped_linear(x [n, in], codes, scales, mins, bias?, bits) -> [n, out]` in x's dtype:
  CPU, n <= DECODE_ROWS, fp32 x: the C GEMV (oval_edge/kernels/grouped_kernels.c), codes read once per 4 rows;
  CPU, more rows (prefill): the C kernel dequantizes DEQUANT_ELEMENTS weights at a time, then one matmul each: in
    bf16 (x and the weights rounded, sums in fp32, the result rounded; as bitsandbytes' 4-bit layers multiply) where
    the GEMV's body is the AVX512-BF16 one, since a bf16 matmul runs at twice the fp32 rate there (prefill of the
    bundled model at 512 tokens measured 398 tok/s in fp32 against bitsandbytes' 951), else in fp32;
  CUDA: the Triton GEMV (oval_edge/kernels/triton_kernels/triton_grouped.py) for n <= DECODE_ROWS, else dequantize + matmul;
  anywhere else, or where a kernel declines: layout.dequantize in row chunks + matmul.
The op is opaque to torch.compile (a fake gives the shape), so the static decode step traces whole; BoundGrouped
calls the same implementation without the dispatcher in eager decode steps (~25 us a call saved, ~120 calls a step).
"""

from __future__ import annotations

import torch
from torch import nn

from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.kernels.gpu import grouped_linear_kernel

from .layout import check_layout, dequantize

DECODE_ROWS = 8  # inputs up to this many rows run the GEMV; more (prefill) dequantize once and multiply
DEQUANT_ELEMENTS = 4 << 20  # weights dequantized at once for a prefill matmul: a 16 MiB fp32 transient at most

# The registry handle lives as long as the process; it is never mutated after these lines.
_LIBRARY = torch.library.Library("oval_edge", "FRAGMENT")
_LIBRARY.define("grouped_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias, int bits) -> Tensor")


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x [n, in] -> x W^T (+ bias) [n, out] in x's dtype (module doc for which path runs)."""
    if x.shape[0] <= DECODE_ROWS:
        out = _gemv(x, codes, scales, mins, bias, bits)
        if out is not None:
            return out
    return _dequantized_matmul(x, codes, scales, mins, bias, bits)


def _gemv(x, codes, scales, mins, bias, bits) -> torch.Tensor | None:
    if x.device.type == "cpu":
        kernels = cpu_kernels()
        if kernels is None or x.dtype != torch.float32:
            return None
        return kernels.gemv_grouped(x if x.stride(-1) == 1 else x.contiguous(), codes, scales, mins,
                                    None if bias is None else bias.float(), bits)
    kernel = grouped_linear_kernel(x.device)
    return None if kernel is None else kernel.grouped_linear(x.contiguous(), codes, scales, mins, bias, bits)


def _dequantized_matmul(x, codes, scales, mins, bias, bits) -> torch.Tensor:
    """W dequantized a row chunk at a time (C on a CPU, torch elsewhere), each chunk multiplied at once."""
    out_features, in_features = codes.shape[0], codes.shape[1] * 8 // bits
    step = max(1, DEQUANT_ELEMENTS // in_features)
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    compute = x.dtype if x.device.type != "cpu" else \
        torch.bfloat16 if kernels is not None and kernels.grouped_rounds_inputs else torch.float32
    xc = x.to(compute)
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32 if x.device.type == "cpu" else compute,
                      device=x.device)
    for first in range(0, out_features, step):
        last = min(out_features, first + step)
        w = kernels.dequantize_grouped(codes, scales, mins, bits, first, last, compute) if kernels else None
        if w is None:
            w = dequantize(codes[first:last], scales[first:last], mins[first:last], bits, compute)
        out[:, first:last] = xc @ w.T
    if bias is not None:
        out += bias.to(out.dtype)
    return out.to(x.dtype)


_LIBRARY.impl("grouped_linear", grouped_linear, "CPU")
_LIBRARY.impl("grouped_linear", grouped_linear, "CUDA")


@torch.library.register_fake("oval_edge::grouped_linear")
def _grouped_linear_fake(x, codes, scales, mins, bias, bits):
    return x.new_empty((x.shape[0], codes.shape[0]))


class GroupedLinear(nn.Module):
    """x [..., in] -> x W^T (+ bias) [..., out] in x's dtype, W held in the grouped format (module doc).

    origin: what the codes came from (a GGML type name such as 'Q4_1', or 'int4' for a 16-bit source), for the
    startup report. The tensors are buffers, so weight_bytes counts them and the weight cache records them.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, in_features: int,
                 bias: torch.Tensor | None = None, origin: str = "") -> None:
        super().__init__()
        self.group = check_layout(codes, scales, mins, bits, in_features)
        self.bits, self.in_features, self.out_features, self.origin = bits, in_features, codes.shape[0], origin
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.oval_edge.grouped_linear(flat, self.codes, self.scales, self.mins, self.bias, self.bits)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized W [out, in] (tests, exports)."""
        return dequantize(self.codes, self.scales, self.mins, self.bits, dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.bits}-bit codes, group {self.group}"
                + (f", from {self.origin}" if self.origin else ""))


class StackedLinear(nn.Module):
    """Row blocks of one fused projection held in different formats (a GGUF that stores, say, q/k as Q4_K and v as
    Q6_K): x -> [part(x) for each part] concatenated along the output. Parts of one format are merged at build, so
    this only exists where the file mixes formats inside a fused projection."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def grouped_projection(parts: list[tuple], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    """One projection from its stored row blocks in order, each (codes, scales, mins, bits, origin): consecutive
    blocks of one layout (bits, group) merge into one GroupedLinear (rows are independent, so stacking their codes
    is exact); a projection whose blocks differ becomes a StackedLinear of those. bias [out] or None."""
    runs: list[tuple[tuple[int, int], list[tuple]]] = []
    for part in parts:
        layout = (part[3], part[0].shape[1] * 8 // part[3] // part[1].shape[1])  # (bits, group)
        if runs and runs[-1][0] == layout:
            runs[-1][1].append(part)
        else:
            runs.append((layout, [part]))
    modules, first = [], 0
    for (bits, _), run in runs:
        codes = torch.cat([p[0] for p in run]).to(device)
        rows = codes.shape[0]
        origin = "+".join(dict.fromkeys(p[4] for p in run))  # the stored types, each once, in order
        modules.append(GroupedLinear(codes, torch.cat([p[1] for p in run]).to(device),
                                     torch.cat([p[2] for p in run]).to(device), bits, codes.shape[1] * 8 // bits,
                                     None if bias is None else bias[first:first + rows].contiguous(), origin))
        first += rows
    return modules[0] if len(modules) == 1 else StackedLinear(modules)


def bind_grouped(module: nn.Module):
    """The decode-time callable of a GroupedLinear (BoundGrouped) or a StackedLinear (its parts bound, outputs
    concatenated); None for any other module."""
    if isinstance(module, GroupedLinear):
        return BoundGrouped(module)
    if isinstance(module, StackedLinear):
        parts = [BoundGrouped(part) for part in module.parts]
        return lambda x: torch.cat([part(x) for part in parts], dim=-1)
    return None


class BoundGrouped:
    """A GroupedLinear bound for decode: x [n, in] -> [n, out], the op's implementation called directly in eager
    steps (no module forward, no dispatcher), the registered op under tracing."""

    def __init__(self, module: GroupedLinear) -> None:
        self.module = module
        self.codes, self.scales, self.mins, self.bits = module.codes, module.scales, module.mins, module.bits
        self.bias = module.bias
        self.path = describe_grouped_path(module.codes.device)
        kernels = cpu_kernels() if module.codes.device.type == "cpu" else None
        bias = None if module.bias is None else module.bias.float()
        # the C GEMV with the weight checked once (oval_edge/kernels/cpu_bound.py), or None
        self.gemv = None if kernels is None else kernels.bind_gemv_grouped(self.codes, self.scales, self.mins, bias,
                                                                             self.bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.dim() != 2:
            return self.module(x)
        if self.gemv is not None and x.shape[0] <= DECODE_ROWS:
            out = self.gemv(x)
            if out is not None:
                return out
        return grouped_linear(x, self.codes, self.scales, self.mins, self.bias, self.bits)


def describe_grouped_path(device: torch.device) -> str:
    """Which path grouped projections run on `device`, for serve's startup report."""
    if device.type == "cpu":
        kernels = cpu_kernels()
        if kernels is None:
            return "grouped integer codes: torch dequantize + matmul (native kernels unavailable)"
        if kernels.grouped_rounds_inputs:
            return ("grouped integer codes: C GEMV for decode (AVX512-BF16: inputs rounded to bf16), C dequantize + "
                    "bf16 matmul for prefill")
        return "grouped integer codes: C GEMV (grouped_kernels.c) for decode, C dequantize + matmul for prefill"
    if grouped_linear_kernel(device) is not None:
        return "grouped integer codes: Triton GEMV for decode, dequantize + matmul for prefill"
    return "grouped integer codes: torch dequantize + matmul (Triton unavailable)"
