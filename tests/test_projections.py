"""The runtime's bound projections and norms compute exactly what the modules they stand for compute."""

from __future__ import annotations

import pytest
import torch

from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.runtime.model.projections import (PackedCpu4bit, Unfused4bit, bind_norm, bind_projection,
                                                 describe_4bit_path)
from oval_edge.runtime.model.quantize import unnest_absmax

bnb = pytest.importorskip("bitsandbytes")


def _linear(in_features: int, out_features: int, bias: bool, quant: str) -> torch.nn.Module:
    """A Linear4bit as bitsandbytes quantizes it (nested absmax, its own layout), not yet called."""
    gen = torch.Generator().manual_seed(in_features + out_features)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.bfloat16, quant_type=quant,
                              compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features, generator=gen), requires_grad=False,
                                     compress_statistics=True, quant_type=quant, blocksize=64).to("cpu")
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen).bfloat16(), requires_grad=False)
    return layer.eval()


def _packed_linear(in_features: int, out_features: int, bias: bool, quant: str) -> torch.nn.Module:
    """A Linear4bit in the layout the loader leaves it in on this CPU (quantize.pack_for_cpu)."""
    layer = _linear(in_features, out_features, bias, quant)
    with torch.no_grad():
        layer(torch.zeros(1, in_features))  # bitsandbytes repacks for its CPU kernel on the first call
    if not getattr(layer.weight.quant_state, "packing_format_for_cpu", False) and cpu_kernels() is not None:
        unnest_absmax(layer.weight.quant_state)  # the loader's step where bitsandbytes has no fused kernel
    return layer


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_4bit_projection_equals_the_module(quant, bias, rows):
    layer = _packed_linear(576, 960, bias, quant)
    bound = bind_projection(layer)
    if getattr(layer.weight.quant_state, "packing_format_for_cpu", False):  # AVX512-BF16 CPUs
        assert isinstance(bound, PackedCpu4bit) and bound.kernel is not None
    elif cpu_kernels() is not None:  # every other CPU: our own GEMV (its own test below)
        assert isinstance(bound, Unfused4bit)
        return
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        expected = layer(x)
        got = bound(x)
        if isinstance(bound, PackedCpu4bit):  # the public-op fallback must agree too
            bound.kernel = None
            assert torch.equal(bound(x), expected)
    assert got.dtype == x.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("bias", [False, True])
def test_unfused_4bit_projection_is_the_exact_product_rounded_as_the_module_rounds(quant, bias):
    """Our 4-bit GEMV (any x86 or Arm CPU) against the exact product of the same codes: x rounded to bf16, times
    code * absmax, rounded to bf16 (+ the bias, rounded again), as Linear4bit computes with a bf16 compute dtype.
    The module itself rounds each weight to bf16 first, so it agrees with both within that rounding's bound."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("native CPU kernels unavailable")
    from bitsandbytes.functional import dequantize_4bit

    layer = _linear(1536, 576, bias, quant)
    state = layer.weight.quant_state
    exact_weight = dequantize_4bit(layer.weight.data, state).double()  # code * absmax before any bf16 rounding
    with torch.inference_mode():
        before = layer(torch.randn(16, 1536, generator=torch.Generator().manual_seed(16)))
    if getattr(state, "packing_format_for_cpu", False):
        pytest.skip("bitsandbytes repacked the weight for its own fused kernel on this CPU")
    unnest_absmax(state)
    bound = Unfused4bit(layer, kernels)
    for rows in (1, 4, 5, 8):  # one row, a full tile of 4, a tile and one, the largest decode batch
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            got, module = bound(x), layer(x)
        exact = x.bfloat16().double() @ exact_weight.T
        if bias:
            exact = exact.bfloat16().double() + layer.bias.double()
        assert got.dtype == torch.float32 and got.shape == (rows, 576)
        magnitude = x.bfloat16().double().abs() @ exact_weight.abs().T  # sum of |x_i w_i| per output
        # One bf16 step (8 significant bits) at each output's magnitude, plus the fp32 sum's own error.
        step = exact.abs() * 2 ** -7 + magnitude * 2 ** -20
        assert bool(((got.double() - exact).abs() <= step).all())
        # Each weight the module rounds moves its output by at most 2^-9 of |x_i w_i|, plus both results' roundings.
        assert bool(((module.double() - got.double()).abs() <= magnitude * 2 ** -9 + 3 * step).all())
    with torch.inference_mode():  # more rows than a decode batch: the module, and un-nesting changed nothing in it
        assert torch.equal(bound(torch.randn(16, 1536, generator=torch.Generator().manual_seed(16))), before)


def test_modules_without_a_packed_kernel_are_called_as_they_are():
    plain = torch.nn.Linear(8, 4)
    assert bind_projection(plain) is plain
    training = _packed_linear(64, 64, False, "nf4").train()
    assert bind_projection(training) is training  # training mode keeps bitsandbytes' own (autograd) path


def test_startup_report_names_the_4bit_path_the_projections_are_bound_to():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _packed_linear(576, 960, False, "nf4"))
    assert describe_4bit_path(model) == bind_projection(model[1]).path
    assert describe_4bit_path(torch.nn.Sequential(torch.nn.Linear(8, 8))) is None


def test_fused_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = torch.randn(7, 576) * 3
    torch.testing.assert_close(bind_norm(norm)(x), norm(x), atol=1e-6, rtol=1e-6)
    half = x.bfloat16()
    assert torch.equal(bind_norm(norm)(half), norm(half))  # other dtypes use the module's own arithmetic
