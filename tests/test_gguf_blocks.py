"""A GGUF's own blocks as grouped integer codes: every supported GGML type against the `gguf` package's own
dequantization, the grouped layout's packing, and the CPU kernels on it against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize
from gguf.constants import GGML_QUANT_SIZES

from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.runtime.model.grouped.gguf_blocks import DECODERS, EXACT_TYPES, convert
from oval_edge.runtime.model.grouped.linear import DECODE_ROWS, GroupedLinear, grouped_linear, grouped_projection
from oval_edge.runtime.model.grouped.layout import (dequantize as grouped_dequantize, pack_codes, quantize_grouped,
                                                     unpack_codes)

# Where each type keeps its fp16 fields (byte offsets in a block): random bytes there could be inf/NaN, so the
# fixtures write sane fp16 values into them and random bytes everywhere else (every other byte pattern is valid).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] uint8: a valid tensor of `type_name` with every code pattern likely."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * width // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        raw[:, offset:offset + 2] = (rng.uniform(1e-3, 2e-2, size=raw.shape[0]).astype(np.float16)
                                     .view(np.uint8).reshape(-1, 2))
    return raw.reshape(rows, -1)


def test_every_decoder_has_a_fixture():
    assert set(DECODERS) == set(FP16_FIELDS)


@pytest.mark.parametrize("type_name", sorted(DECODERS))
def test_blocks_match_the_gguf_packages_dequantization(type_name):
    rows, width = 6, 512  # two K-quant super-blocks a row
    raw = random_blocks(type_name, rows, width)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
    codes, scales, mins, bits = convert(raw, type_name)
    got = grouped_dequantize(codes, scales, mins, bits)
    assert got.shape == (rows, width)
    if type_name in EXACT_TYPES:
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the file's values, bit for bit
    else:  # the product scale d * sc rounded to fp16: relative error below 2^-11 of the block's scale
        bound = (scales.float().abs().repeat_interleave(width // scales.shape[1], 1) * 32 + mins.float().abs()
                 .repeat_interleave(width // mins.shape[1], 1)) * 2 ** -11
        assert bool(((got - want).abs() <= bound + 1e-12).all())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_written_by_the_gguf_quantizer(type_name):
    """The gguf package's own quantizer writes the blocks (the form a real file has), read back exactly."""
    weight = np.random.default_rng(1).normal(0, 0.02, size=(8, 96)).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType[type_name])
    codes, scales, mins, bits = convert(raw, type_name)
    want = dequantize(raw, GGMLQuantizationType[type_name])
    assert torch.equal(grouped_dequantize(codes, scales, mins, bits), torch.from_numpy(want.astype(np.float32)))


def test_types_without_a_grouped_form_are_declined():
    assert convert(np.zeros((2, 64), dtype=np.uint8), "IQ4_NL") is None
    assert convert(np.zeros((2, 64), dtype=np.float32), "F32") is None


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits):
    codes = torch.randint(0, 2 ** bits, (5, 96), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 96 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # GGML's nibble order: byte i of a chunk holds weights i (low) and i + 16 (high)
        assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 16]) << 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_grouped_error_is_within_half_a_step(bits):
    weight = torch.randn(16, 128) * 0.05
    codes, scales, mins = quantize_grouped(weight, bits, 32)
    error = (grouped_dequantize(codes, scales, mins, bits) - weight).abs()
    step = scales.float().repeat_interleave(32, 1)
    assert bool((error <= step / 2 + 1e-6 + mins.float().abs().repeat_interleave(32, 1) * 2 ** -11).all())


def op_reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(x W^T as the op computes it, tolerance): where the CPU's GEMV body is the AVX512-BF16 one, decode-sized x is
    rounded to bf16 and prefill-sized inputs multiply in bf16 (x and W rounded, the result rounded); elsewhere fp32."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.grouped_rounds_inputs:
        return x @ weight.T, 1e-4
    if x.shape[-2] <= DECODE_ROWS:
        # The body's 4-bit code words are 128 + code, the 128 taken back out through the mins' term
        # (grouped_bf16.h): that cancellation leaves fp32 errors near 2^-24 x 128 x sum|scale x|, measured up to
        # 2.2e-4 (of |want| + 1) over 200 seeds of the mixed-type projection below.
        return x.bfloat16().float() @ weight.T, 5e-4
    return x.bfloat16().float() @ weight.bfloat16().float().T, 2e-2  # and the output's bf16 rounding


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])  # the GEMV's tile of 4 and its remainder; 20: the prefill path
def test_the_op_matches_the_reference_matmul(type_name, rows):
    weight_rows, width = 40, 256
    codes, scales, mins, bits = convert(random_blocks(type_name, weight_rows, width, seed=rows), type_name)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(weight_rows, generator=gen)
    x = torch.randn(rows, width, generator=gen)
    want, tolerance = op_reference(x, grouped_dequantize(codes, scales, mins, bits))
    want = want + bias
    got = grouped_linear(x, codes, scales, mins, bias, bits)
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    module = GroupedLinear(codes, scales, mins, bits, width, bias, type_name)
    torch.testing.assert_close(module(x[None]), want[None], rtol=tolerance, atol=tolerance)


def test_a_projection_of_mixed_types_stacks_its_row_blocks():
    """q/k as Q4_K and v as Q6_K in one fused projection: two GroupedLinears, outputs in row order."""
    parts = [(*convert(random_blocks(t, rows, 256, seed=i), t), t)
             for i, (t, rows) in enumerate([("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)])]
    module = grouped_projection(parts, None, torch.device("cpu"))
    assert [p.origin for p in module.parts] == ["Q4_K", "Q6_K"] and module.out_features == 64
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    want, tolerance = op_reference(x, torch.cat([grouped_dequantize(*p[:4]) for p in parts]))
    torch.testing.assert_close(module(x), want, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")
def test_the_c_kernels_decline_what_they_do_not_take():
    kernels = cpu_kernels()
    codes, scales, mins, bits = convert(random_blocks("Q4_0", 4, 64), "Q4_0")
    assert kernels.gemv_grouped(torch.randn(2, 64, dtype=torch.float64), codes, scales, mins, None, bits) is None
    assert kernels.gemv_grouped(torch.randn(2, 64), codes, scales.float(), mins, None, bits) is None
    assert kernels.gemv_grouped(torch.randn(2, 64), codes, scales, mins, None, 8) is None  # codes too short for 8
