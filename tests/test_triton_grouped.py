"""The grouped-format projection kernel (oval_edge/kernels/triton_kernels/triton_grouped.py) against the torch reference
(runtime/model/grouped/layout.py's `dequantize`), in Triton's interpreter on CPU tensors (no GPU here); its
refusals, its loader (oval_edge/kernels/gpu.py) and its capturability (no host read of a tensor value).

Cases: 4- and 8-bit codes in groups of 16 and 32; 1, 3, 8 and 17 rows (17: more than one 16-row dot tile); K of
2, 3 and 18 chunks; 40 and 100 output rows (neither a multiple of the 32-row block); with and without a bias;
fp32 and fp16 rows (the interpreter mis-handles bf16: the device's self-check covers it, make gpu-check). A chosen
matrix rather than the full product (the interpreter is slow), every listed value present.

Tolerances. The reference is x.float() @ W^T (+ bias) in fp32, W dequantized in fp32 from the same codes, on the
same (already rounded) rows, so only the summation order and the output's rounding differ: fp32 1e-5 and fp16
2e-3 x max(1, |ref|) (the latter ~4x half an fp16 ulp, 2^-11, on values of that size).
"""

from __future__ import annotations

import importlib
import logging
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the x86_64 test extra has it); the torch ops cover "
                                     "grouped weights without it")

# TRITON_INTERPRET is read when @triton.jit runs, i.e. when the kernel modules are imported: set it first, reload
# them if this worker imported them earlier without it, then put the variable back for the other test files.
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from oval_edge.kernels import gpu  # noqa: E402
from oval_edge.kernels.triton_kernels import triton_check, triton_grouped, triton_ops  # noqa: E402

if not all(isinstance(f, InterpretedFunction) for f in (triton_ops._add, triton_grouped._grouped_kernel)):
    for _module in (triton_ops, triton_grouped):  # the kernel binds triton_ops' reductions
        importlib.reload(_module)
if _PREVIOUS is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS

from oval_edge.runtime.engine.forward.op_trace import OpTrace  # noqa: E402
from oval_edge.runtime.model.grouped.layout import dequantize  # noqa: E402

F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}


def _weights(seed: int, bits: int, group: int, out_features: int, hidden: int):
    """Random stored codes [out, K * bits / 8] uint8 and fp16 scales, mins [out, K / group] (mins negative, as
    an asymmetric quantizer's are), and a bias [out]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out_features, hidden * bits // 8), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, hidden // group, generator=gen) / 2 ** bits).half()
    mins = (-torch.rand(out_features, hidden // group, generator=gen)).half()
    return codes, scales, mins, torch.randn(out_features, generator=gen)


def _near(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= tol * max(1.0, float(expected.abs().max())), f"max abs diff {error:.3g}"


# (bits, group, rows of x, K, out, bias, dtype of x)
CASES = [
    (4, 32, 1, 64, 40, True, F32), (4, 32, 8, 576, 100, False, F16), (4, 32, 17, 96, 40, True, F16),
    (4, 16, 3, 96, 100, False, F32), (4, 16, 1, 576, 40, True, F16), (4, 16, 17, 64, 100, True, F32),
    (8, 32, 3, 576, 40, True, F32), (8, 32, 1, 96, 100, False, F16), (8, 32, 8, 64, 40, False, F32),
    (8, 16, 8, 96, 100, True, F16), (8, 16, 17, 576, 40, False, F32), (8, 16, 3, 64, 40, True, F16),
]
IDS = [f"{b}bit-g{g}-n{n}-K{k}-out{o}-{'bias' if bias else 'nobias'}-{str(dt)[6:]}"
       for b, g, n, k, o, bias, dt in CASES]


@pytest.mark.parametrize("bits, group, rows, hidden, out_features, with_bias, dtype", CASES, ids=IDS)
def test_grouped_linear_equals_the_dequantized_matmul(bits, group, rows, hidden, out_features, with_bias, dtype):
    codes, scales, mins, bias = _weights(rows * hidden + bits, bits, group, out_features, hidden)
    bias = bias if with_bias else None
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype)
    actual = triton_grouped.grouped_linear(x, codes, scales, mins, bias, bits)
    assert actual.shape == (rows, out_features) and actual.dtype == dtype
    expected = x.float() @ dequantize(codes, scales, mins, bits).T + (0 if bias is None else bias)
    _near(actual, expected, TOL[dtype])


def test_grouped_linear_declines_what_it_does_not_take():
    codes, scales, mins, bias = _weights(1, 4, 32, 40, 64)
    x = torch.randn(2, 64)
    take = triton_grouped.grouped_linear
    assert take(x.bfloat16(), codes, scales, mins, bias, 4) is None  # interpreter: no bf16
    assert take(x.double(), codes, scales, mins, bias, 4) is None  # not a kernel dtype
    assert take(x, codes, scales, mins, bias, 5) is None  # not a code width
    assert take(x, codes, scales, mins, bias, 8) is None  # 8-bit codes would be [40, 64]
    assert take(x[:, :48], codes, scales, mins, bias, 4) is None  # K is not the codes'
    assert take(x, codes.to(torch.int8), scales, mins, bias, 4) is None  # codes are uint8
    assert take(x, codes, scales.float(), mins, bias, 4) is None  # scales are fp16
    assert take(x, codes, scales, mins[:, :1], bias, 4) is None  # mins' shape differs from the scales'
    assert take(x, codes, scales[:, :1], mins[:, :1], bias, 4) is None  # a group of 64
    assert take(x, codes, scales, mins, bias[:20], 4) is None  # bias [out]
    assert take(x.t().contiguous().t(), codes, scales, mins, bias, 4) is None  # non-contiguous rows
    assert take(x, codes, scales, mins, bias, 4) is not None
    assert take(torch.randn(0, 64), codes, scales, mins, bias, 4).shape == (0, 40)  # nothing to launch


def test_grouped_linear_check_passes_in_the_interpreter():
    assert triton_check.grouped_linear_check(triton_grouped, torch.device("cpu")) is None


@pytest.fixture
def interpreted_loader(monkeypatch):
    """The loader under TRITON_INTERPRET=1 with the switch unset, gpu.load_grouped_linear's cache (per device type
    and interpreter mode) emptied before and after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(gpu.TRITON_ENV, raising=False)
    gpu.load_grouped_linear.cache_clear()
    yield gpu.grouped_linear_kernel
    gpu.load_grouped_linear.cache_clear()


def test_loader_offers_the_checked_module_under_the_interpreter_only(interpreted_loader, monkeypatch):
    assert interpreted_loader(torch.device("cpu")) is triton_grouped
    monkeypatch.setenv(gpu.TRITON_ENV, "0")
    assert interpreted_loader(torch.device("cpu")) is None
    monkeypatch.delenv(gpu.TRITON_ENV)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreted_loader(torch.device("cpu")) is None
    assert interpreted_loader(torch.device("meta")) is None


def test_loader_falls_back_when_the_check_fails(interpreted_loader, monkeypatch, caplog):
    monkeypatch.setattr(triton_check, "grouped_linear_check", lambda module, device: "grouped_linear 4-bit")
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        assert interpreted_loader(torch.device("cpu")) is None
        assert interpreted_loader(torch.device("cpu")) is None
    assert gpu.load_grouped_linear("cpu", True) == "self-check failed: grouped_linear 4-bit"
    assert len([r for r in caplog.records if "disagrees" in r.getMessage()]) == 1  # logged once


def test_grouped_linear_reads_no_tensor_value_on_the_host(monkeypatch):
    """What CUDA-graph capture needs of the entry point: no op that reads a device value on the host (item(),
    bool(), nonzero), no copy between devices, and the output, grid and block sizes from shapes alone. Run whole
    (the interpreter's own staging copies show up, all on the host) and with the launch recorded instead, where
    the output's allocation is the only op."""
    codes, scales, mins, bias = _weights(2, 8, 16, 40, 96)
    x = torch.randn(3, 96)
    expected = triton_grouped.grouped_linear(x, codes, scales, mins, bias, 8)

    def refuse(*_args, **_kwargs):
        raise AssertionError("grouped_linear read a tensor's value on the host")

    launches = []

    class Recorder:  # kernel[grid](*args, **constexprs)
        def __getitem__(self, grid):
            return lambda *args, **constexprs: launches.append((grid, constexprs))

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        with torch.inference_mode(), OpTrace() as whole:
            actual = triton_grouped.grouped_linear(x, codes, scales, mins, bias, 8)
        patch.setattr(triton_grouped, "_grouped_kernel", Recorder())
        with torch.inference_mode(), OpTrace() as entry:
            triton_grouped.grouped_linear(x, codes, scales, mins, bias, 8)
    assert whole.host_reads == [] and whole.device_copies == []
    assert torch.equal(actual, expected)
    assert [name for name, _ in entry.calls] == ["aten.empty.memory_format"]
    (grid, constexprs), = launches
    assert grid == (2, 1) and constexprs["BLOCK_N"] == 16 and constexprs["GROUP"] == 16
