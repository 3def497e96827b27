"""The runtime's bound projections and norms compute exactly what the modules they stand for compute."""

from __future__ import annotations

import pytest
import torch

from oval_edge.runtime.model.projections import PackedCpu4bit, bind_norm, bind_projection

bnb = pytest.importorskip("bitsandbytes")


def _packed_linear(in_features: int, out_features: int, bias: bool, quant: str) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(in_features + out_features)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.bfloat16, quant_type=quant,
                              compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features, generator=gen), requires_grad=False,
                                     compress_statistics=True, quant_type=quant, blocksize=64).to("cpu")
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen).bfloat16(), requires_grad=False)
    layer.eval()
    with torch.no_grad():
        layer(torch.zeros(1, in_features))  # bitsandbytes repacks for its CPU kernel on the first call
    return layer


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_4bit_projection_equals_the_module(quant, bias, rows):
    layer = _packed_linear(576, 960, bias, quant)
    bound = bind_projection(layer)
    if getattr(layer.weight.quant_state, "packing_format_for_cpu", False):  # AVX512-BF16 CPUs (this CI machine)
        assert isinstance(bound, PackedCpu4bit) and bound.kernel is not None
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        expected = layer(x)
        got = bound(x)
        if isinstance(bound, PackedCpu4bit):  # the public-op fallback must agree too
            bound.kernel = None
            assert torch.equal(bound(x), expected)
    assert got.dtype == x.dtype == torch.float32
    assert torch.equal(got, expected)


def test_modules_without_a_packed_kernel_are_called_as_they_are():
    plain = torch.nn.Linear(8, 4)
    assert bind_projection(plain) is plain
    training = _packed_linear(64, 64, False, "nf4").train()
    assert bind_projection(training) is training  # training mode keeps bitsandbytes' own (autograd) path


def test_fused_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = torch.randn(7, 576) * 3
    torch.testing.assert_close(bind_norm(norm)(x), norm(x), atol=1e-6, rtol=1e-6)
    half = x.bfloat16()
    assert torch.equal(bind_norm(norm)(half), norm(half))  # other dtypes use the module's own arithmetic
