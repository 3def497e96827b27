"""grouped_kernels.c's three bodies (AVX-512, AVX2, portable C: the one an Arm board builds) against the reference
dequantization, each compiled alone from the shipped source with the flags that select it, called through ctypes."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from oval_edge.kernels import cpu_build
from oval_edge.runtime.model.grouped.layout import dequantize, pack_codes

SOURCE = Path(cpu_build.__file__).with_name("grouped_kernels.c")
COMPILER = shutil.which("cc") or shutil.which("gcc")
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split("flags")[1].splitlines()[0].split()) \
    if Path("/proc/cpuinfo").exists() and "flags" in Path("/proc/cpuinfo").read_text() else set()
BODIES = {  # name: (flags, CPU features it needs to run)
    "avx512-bf16": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"],
                    {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}),
    "avx512": (["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-mno-avx512bf16"], {"avx512f", "avx2", "fma", "f16c"}),
    "avx2": (["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"], {"avx2", "fma", "f16c"}),
    "portable": (["-mno-avx", "-mno-avx2", "-mno-f16c", "-mno-fma"], set()),
}
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


@pytest.fixture(scope="module", params=sorted(BODIES))
def body(request, tmp_path_factory):
    flags, needs = BODIES[request.param]
    if COMPILER is None or "x86" not in subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout \
            and request.param != "portable":
        pytest.skip("needs a C compiler (and x86 for the vector bodies)")
    if not needs <= CPU_FLAGS:
        pytest.skip(f"this CPU lacks {sorted(needs - CPU_FLAGS)}")
    built = tmp_path_factory.mktemp(request.param) / "grouped.so"
    done = subprocess.run([COMPILER, *cpu_build.OPTIMISE_FLAGS, "-fPIC", "-shared", "-fopenmp", *flags, "-o",
                           str(built), str(SOURCE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    library = ctypes.CDLL(str(built))
    library.gemv_grouped_f32.argtypes = [_ptr, _i64, _i64] + [_ptr] * 3 + [_i64] * 2 + [_ptr, _i64, _i64, _ptr,
                                                                                           _i64, _i64]
    library.dequantize_grouped.argtypes = [_ptr] * 3 + [_i64] * 6 + [_ptr, _i64, _i64]
    assert library.grouped_rounds_inputs() == (request.param == "avx512-bf16")  # only that body rounds x to bf16
    return library


def random_weight(bits: int, group: int, rows: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = pack_codes(torch.randint(0, 2 ** bits, (rows, width), generator=gen), bits)
    scales = (torch.rand(rows, width // group, generator=gen) / 16).half()
    mins = (-torch.rand(rows, width // group, generator=gen) / 2).half()
    return codes, scales, mins


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 32), (8, 16)])
@pytest.mark.parametrize("rows", [1, 2, 4, 7])  # tiles of 4, the single row, and remainders
# 6 chunks of 32: whole steps only; 19: a step of four chunks, a pair and an odd last chunk, and more groups than a
# vector's 16 (the single-row 512-bit path's remainders)
@pytest.mark.parametrize("width", [192, 608])
def test_gemv_matches_the_reference(body, bits, group, rows, width):
    n_out = 37
    codes, scales, mins = random_weight(bits, group, n_out, width, seed=rows * bits + group)
    x = torch.randn(rows, width + 8)[:, :width]  # a row stride wider than the row, as a view of a larger buffer
    bias = torch.randn(n_out)
    out = torch.empty(rows, n_out)
    code = body.gemv_grouped_f32(x.data_ptr(), rows, x.stride(0), codes.data_ptr(), scales.data_ptr(),
                                 mins.data_ptr(), bits, group, bias.data_ptr(), n_out, width, out.data_ptr(),
                                 out.stride(0), 2)
    assert code == 0
    inputs = x.bfloat16().float() if body.grouped_rounds_inputs() else x  # the bf16 body's arithmetic
    want = inputs @ dequantize(codes, scales, mins, bits).T + bias
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)  # fp32 sums in another order


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16)])
def test_dequantize_matches_the_reference(body, bits, group):
    codes, scales, mins = random_weight(bits, group, 12, 96, seed=bits)
    want = dequantize(codes, scales, mins, bits)[4:9]
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(5, 96, dtype=dtype)
        assert body.dequantize_grouped(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), bits, group, 12, 96, 4,
                                       9, out.data_ptr(), int(dtype == torch.bfloat16), 1) == 0
        torch.testing.assert_close(out, want.to(dtype), rtol=1e-6, atol=1e-7)  # bf16: rounded like torch rounds


def test_refused_shapes_return_one(body):
    codes, scales, mins = random_weight(4, 32, 4, 64, seed=0)
    out, x = torch.empty(1, 4), torch.randn(1, 64)
    args = (codes.data_ptr(), scales.data_ptr(), mins.data_ptr())
    assert body.gemv_grouped_f32(x.data_ptr(), 1, 64, *args, 5, 32, None, 4, 64, out.data_ptr(), 4, 1) == 1  # 5 bits
    assert body.gemv_grouped_f32(x.data_ptr(), 1, 64, *args, 4, 64, None, 4, 64, out.data_ptr(), 4, 1) == 1  # group
    assert body.gemv_grouped_f32(x.data_ptr(), 1, 48, *args, 4, 16, None, 4, 48, out.data_ptr(), 4, 1) == 1  # k % 32
    assert body.dequantize_grouped(*args, 4, 32, 4, 64, 2, 9, out.data_ptr(), 0, 1) == 1  # rows past the end
