"""The ways to multiply a batch of rows by a 4-bit weight, timed side by side on one device (`make gpu-check` runs it).

Why: a decode step of B > 1 rows is bound by the bytes its projections read. runtime/model/projections.py chooses
Chunked4bit by bytes moved per weight (weight_bytes_moved); this measures the options it chose among, and one it did
not take, on the device at hand:
    module       bitsandbytes' Linear4bit as is (matmul_4bit: its fused GEMM or dequantize + matmul, its own choice)
    chunked      Chunked4bit: calls of at most 4 rows through the same module (what the runtime runs)
    gemv_rows    one call per row (bitsandbytes' 4-bit GEMV)
    dequantize   a 16-bit copy of the weight, then one matmul (what bnb falls back to)
    int4pack     torch's built-in int4 weight-only kernel (tinygemm, `aten._weight_int4pack_mm`) on the same weight
                 re-quantized to asymmetric int4 in groups of 64: one read of 0.5 B per weight for any row count,
                 but another format than NF4 (a `--quant int4` would have to be measured for quality first)
On CUDA each option is captured into a CUDA graph of REPS calls and timed by events, so launch overhead (which the
runtime's own graphs remove) does not hide the kernels' cost; on a CPU it is a plain timed loop.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

from oval_edge.tools.timing import median, repeat_times

REPS = 20
SHAPES = {"smollm2 gate_up": (3072, 576), "llama3-8b down": (4096, 14336)}  # (out_features, in_features)


def four_bit_options(module, dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from bitsandbytes.functional import dequantize_4bit

    from oval_edge.runtime.model.projections import Chunked4bit

    # The codes as quantized, kept aside: on a CPU bitsandbytes repacks the module's weight at its first call.
    codes, state = module.weight.data.clone(), copy.deepcopy(module.weight.quant_state)
    options = {
        "module": module,
        "chunked": Chunked4bit(module),
        "gemv_rows": lambda x: torch.cat([module(x[i:i + 1]) for i in range(x.shape[0])]),
        "dequantize": lambda x: F.linear(x, dequantize_4bit(codes, state).to(dtype)),
    }
    int4 = _int4pack(dequantize_4bit(codes, state).float(), dtype)
    if int4 is not None:
        options["int4pack"] = int4
    return options


def _int4pack(weight: torch.Tensor, dtype: torch.dtype, group: int = 64):
    """The weight [out, in] as torch's int4-packed layout with per-group scales and zeros, or None where the device or
    this torch lacks the kernel (it needs bf16 activations and sm_80+ on CUDA)."""
    out_f, in_f = weight.shape
    groups = weight.view(out_f, in_f // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
    # tinygemm's zero point is the value of code 8: w = (code - 8) * scale + zero.
    zeros = low + 8 * scale
    scales_zeros = torch.stack([scale.squeeze(-1), zeros.squeeze(-1)], -1).transpose(0, 1).contiguous()  # [G, out, 2]
    try:
        if weight.is_cuda:
            packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
            sz = scales_zeros.to(torch.bfloat16)
            return lambda x: torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), packed, group, sz).to(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = scales_zeros.to(dtype)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def time_option(fn: Callable, x: torch.Tensor) -> float:
    """Median microseconds per call."""
    if x.is_cuda:
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                fn(x)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / REPS)
        return median(times)
    return median(repeat_times(lambda: fn(x), REPS, warmup=1)) * 1e6


def measure(device: torch.device, dtype: torch.dtype, rows: tuple[int, ...] = (1, 2, 4, 8, 16),
            shapes: dict[str, tuple[int, int]] = SHAPES) -> list[dict]:
    """One row per (shape, rows): microseconds of each option, and the error of each against `module`."""
    from oval_edge.runtime.model.quantize import linear4bit

    torch.manual_seed(0)
    results = []
    for name, (out_f, in_f) in shapes.items():
        weight = torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.02
        module = linear4bit(weight, None, "nf4", dtype, device).eval()
        with torch.inference_mode():
            options = four_bit_options(module, dtype)
            for n in rows:
                x = torch.randn(n, in_f, device=device, dtype=dtype)
                reference = module(x).float()
                row = {"shape": name, "out": out_f, "in": in_f, "rows": n}
                for option, fn in options.items():
                    row[f"{option}_us"] = round(time_option(fn, x), 2)
                    row[f"{option}_err"] = float((fn(x).float() - reference).abs().max() / reference.abs().max())
                results.append(row)
    return results


def format_rows(results: list[dict]) -> str:
    options = [k[:-3] for k in results[0] if k.endswith("_us")] if results else []
    lines = ["shape             rows " + " ".join(f"{o:>11s}" for o in options) + "   (us per call)"]
    for r in results:
        lines.append(f"{r['shape']:17s} {r['rows']:4d} " + " ".join(f"{r[o + '_us']:11.1f}" for o in options))
    return "\n".join(lines)


if __name__ == "__main__":
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(format_rows(measure(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)))
