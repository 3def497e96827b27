"""Issue #51, bitsandbytes before 0.50 on CUDA: its gemv_4bit (one call per decode row, projections.Chunked4bit)
rebuilt the double-quantized absmax before every GEMV, and weight_bytes_moved left that out.

The loader now un-nests the absmax to fp32 at load on CUDA where bitsandbytes has no fused gemm_4bit
(quantize.unnest_at_load); the chunking table counts the absmax each path reads (and rebuilds). Checked on CPU
tensors, where bitsandbytes' functional gemv_4bit takes the same nested state and rebuilds it the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oval_edge.runtime.model.projections import chunk_rows, weight_bytes_moved
from oval_edge.runtime.model.quantize import (import_bitsandbytes, linear4bit, unnest_absmax, unnest_at_load,
                                              weight_bytes)
from oval_edge.tools.plan.weights import linear4bit_bytes

OUT, IN = 96, 128


class Dispatched(TorchDispatchMode):
    """The ops one call dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def nested():
    torch.manual_seed(0)
    module = linear4bit(torch.randn(OUT, IN, dtype=torch.bfloat16), None, "nf4", torch.bfloat16, torch.device("cpu"))
    assert module.weight.quant_state.nested  # a CPU build keeps bitsandbytes' double quantization
    return module


def test_the_absmax_is_unnested_at_load_on_cuda_only_without_the_fused_gemm():
    assert unnest_at_load(torch.device("cuda"), fused_gemm=False)  # bitsandbytes 0.45-0.49
    assert not unnest_at_load(torch.device("cuda"), fused_gemm=True)  # 0.50+: gemm_4bit reads the 8-bit absmax
    assert not unnest_at_load(torch.device("cpu"), fused_gemm=False)  # the CPU has its own rule (pack_for_cpu)


def test_a_nested_gemv_rebuilds_the_absmax_at_every_call_and_an_unnested_one_gives_the_same_output(nested):
    functional = import_bitsandbytes().functional
    state = nested.weight.quant_state
    flat = copy.deepcopy(state)
    unnest_absmax(flat)
    assert not flat.nested and flat.absmax.dtype == torch.float32 and flat.state2 is None
    x = torch.randn(1, IN, dtype=torch.bfloat16)
    with Dispatched() as before:
        rebuilt = functional.gemv_4bit(x, nested.weight.data.t(), state=state)
    with Dispatched() as after:
        direct = functional.gemv_4bit(x, nested.weight.data.t(), state=flat)
    assert "bitsandbytes.dequantize_blockwise.default" in before.ops  # the per-call rebuild being removed
    assert after.ops.count("bitsandbytes.gemv_4bit.default") == 1 and not any("dequantize" in op for op in after.ops)
    assert torch.equal(direct, rebuilt)
    assert torch.equal(functional.dequantize_4bit(nested.weight.data, flat),
                       functional.dequantize_4bit(nested.weight.data, state))


def test_the_unnested_absmax_is_counted_in_the_weight_bytes(nested):
    codes, state_bytes = linear4bit_bytes(OUT, IN, "nested")
    assert weight_bytes(nested) == codes + state_bytes
    flat = copy.deepcopy(nested)
    unnest_absmax(flat.weight.quant_state)
    codes, state_bytes = linear4bit_bytes(OUT, IN, "cpu-unnested")  # the same layout: codes, fp32 absmax, code book
    assert weight_bytes(flat) == codes + state_bytes == codes + OUT * IN // 64 * 4 + 16 * 4


def test_bytes_moved_count_the_absmax_each_call_reads_or_rebuilds():
    nested_rows, flat_rows = weight_bytes_moved(8, False, nested=True), weight_bytes_moved(8, False, nested=False)
    assert nested_rows["gemv_rows"] == 8 * (0.5 + 9 / 64)  # read the 8-bit codes, write fp32, read it back: per row
    assert flat_rows["gemv_rows"] == 8 * (0.5 + 4 / 64)
    assert weight_bytes_moved(8, True, nested=True)["fused_chunks"] == 2 * (0.5 + 1 / 64)
    # un-nested below 0.50, one GEMV per row still moves the fewest bytes up to 8 rows; nested it would stop at 7
    assert [chunk_rows(n, False, nested=False) for n in (1, 8, 9)] == [1, 1, 9]
    assert chunk_rows(8, False, nested=True) == 8
