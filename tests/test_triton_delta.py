"""The gated delta rule's decode-step kernel (oval_edge/kernels/triton_kernels/triton_delta.py) against the torch step
(runtime/engine/forward/state_mixers.py `gated_delta_step`), in Triton's interpreter on CPU tensors (no GPU here);
its refusals and its capturability (no host read of a tensor value). Not wired into the runtime yet.

Cases: Hv = Hk and Hv = 2 Hk; dk 16 and 32; dv a multiple of the kernel's 16-column block and not (24, 8); batch 1,
3 and 5 with padding rows repeating row 0's slot and input; fp32 and fp16 inputs (the interpreter mis-handles bf16:
declined there). Tolerances: both sides compute in fp32 from the same (already rounded) inputs, so only the
summation order and the output's rounding differ: fp32 1e-5, fp16 2e-3 x max(1, |ref|) (~4x half an fp16 ulp).
"""

from __future__ import annotations

import importlib
import os
from unittest import mock

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the x86_64 test extra has it); the torch step covers "
                                     "decoding without it")
from test_triton_grouped import F16, F32, TOL, _near  # its import also sets up the interpreter for triton_ops
from triton.runtime.interpreter import InterpretedFunction

from oval_edge.runtime.engine.forward.op_trace import OpTrace
from oval_edge.runtime.engine.forward.state_mixers import gated_delta_step

# TRITON_INTERPRET is read when @triton.jit runs, i.e. when a kernel module is imported: import (or reload, if this
# worker imported it without the variable) with it set, and leave the environment as it was for other test files.
with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
    from oval_edge.kernels.triton_kernels import triton_delta, triton_ops
    if not all(isinstance(f, InterpretedFunction) for f in (triton_ops._add, triton_delta._delta_step_kernel)):
        for _module in (triton_ops, triton_delta):  # in this order: the kernel binds triton_ops' reductions
            importlib.reload(_module)


def _step_inputs(seed: int, slots: list[int], key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype):
    """q, k, v, g, beta for len(slots) rows; a row whose slot an earlier row has is that row's padding copy."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(slots)
    q, k = (torch.randn(rows, key_heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(rows, value_heads, value_dim, generator=gen)
    g = -torch.rand(rows, value_heads, generator=gen)
    beta = torch.rand(rows, value_heads, generator=gen)
    source = [slots.index(slot) for slot in slots]  # each row's first row with its slot
    return [t[source].to(dtype).contiguous() for t in (q, k, v, g, beta)]


# (slots of the rows, Hk, Hv, dk, dv, dtype)
CASES = [
    ([3], 2, 2, 16, 16, F32),
    ([2, 0, 1, 2, 2], 2, 4, 32, 24, F32),
    ([1, 3, 0], 1, 2, 16, 8, F16),
    ([0, 2, 0], 2, 4, 16, 32, F16),
]
IDS = [f"B{len(s)}-Hk{hk}-Hv{hv}-dk{dk}-dv{dv}-{str(dt)[6:]}" for s, hk, hv, dk, dv, dt in CASES]


@pytest.mark.parametrize("slots, key_heads, value_heads, key_dim, value_dim, dtype", CASES, ids=IDS)
def test_three_steps_equal_the_torch_step(slots, key_heads, value_heads, key_dim, value_dim, dtype):
    """Three steps in a row (each step reads the state the last one wrote), outputs and states against the torch
    step on a copy of the same pool; slots no row names are never written."""
    pool = torch.randn(4, value_heads, key_dim, value_dim, generator=torch.Generator().manual_seed(7)) * 0.3
    theirs = pool.clone()
    index = torch.tensor(slots)
    for step in range(3):
        inputs = _step_inputs(step, slots, key_heads, value_heads, key_dim, value_dim, dtype)
        actual = triton_delta.gated_delta_step(*inputs, pool, index)
        expected = gated_delta_step(*inputs, theirs, index)
        assert actual.shape == expected.shape and actual.dtype == dtype
        _near(actual, expected, TOL[dtype])
        _near(pool, theirs, TOL[F32])  # the state is fp32 whatever the inputs' dtype
    untouched = [slot for slot in range(4) if slot not in slots]
    assert torch.equal(pool[untouched], torch.randn(4, value_heads, key_dim, value_dim,
                                                    generator=torch.Generator().manual_seed(7))[untouched] * 0.3)


def test_padding_rows_take_their_first_rows_output():
    slots = [1, 0, 1, 1]
    pool = torch.randn(2, 2, 16, 16) * 0.3
    inputs = _step_inputs(3, slots, 2, 2, 16, 16, F32)
    out = triton_delta.gated_delta_step(*inputs, pool, torch.tensor(slots))
    assert torch.equal(out[2], out[0]) and torch.equal(out[3], out[0])


def test_gated_delta_step_declines_what_it_does_not_take():
    inputs = _step_inputs(1, [0, 1], 2, 4, 16, 16, F32)
    states, slots = torch.zeros(2, 4, 16, 16), torch.tensor([0, 1])
    take = triton_delta.gated_delta_step
    assert take(*inputs, states, slots) is not None
    assert take(*[t.bfloat16() for t in inputs], states, slots) is None  # interpreter: no bf16
    assert take(*[t.double() for t in inputs], states, slots) is None  # not a kernel dtype
    assert take(*inputs, states.half(), slots) is None  # the state is fp32
    assert take(*inputs, states, slots.int()) is None  # slots are int64
    assert take(*inputs, states[:, :2], slots) is None  # the state's heads are not v's
    assert take(*inputs, states.transpose(-1, -2).contiguous().transpose(-1, -2), slots) is None  # non-contiguous
    q, k, v, g, beta = _step_inputs(1, [0, 1], 2, 4, 24, 16, F32)  # dk = 24: not a power of two
    assert take(q, k, v, g, beta, torch.zeros(2, 4, 24, 16), slots) is None
    q, k, v, g, beta = _step_inputs(1, [0, 1], 3, 4, 16, 16, F32)  # 4 value heads over 3 key heads
    assert take(q, k, v, g, beta, states, slots) is None
    assert take(*[t[:0] for t in inputs], states, slots[:0]).shape == (0, 4, 16)  # nothing to launch


class LaunchRecorder:
    """Stands in for the kernel: `kernel[grid](*args, **constexprs)` records (grid, constexprs) and runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        return lambda *_args, **constexprs: self.launches.append((grid, constexprs))


def test_gated_delta_step_reads_no_tensor_value_on_the_host(monkeypatch):
    """What CUDA-graph capture needs of the entry point: no op that reads a device value on the host (item(),
    bool(), nonzero), no copy between devices, the grid and block sizes from shapes alone. Run whole (the
    interpreter's own staging copies show up, all on the host), then with the launch recorded instead."""
    slots = torch.tensor([1, 0, 1])
    inputs = _step_inputs(5, [1, 0, 1], 2, 4, 16, 24, F32)
    pool = torch.randn(2, 4, 16, 24)
    expected = triton_delta.gated_delta_step(*inputs, pool.clone(), slots)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *_: pytest.fail("the delta step read a tensor on the host"))
    with torch.inference_mode(), OpTrace() as whole:
        actual = triton_delta.gated_delta_step(*inputs, pool, slots)
    recorder = LaunchRecorder()
    monkeypatch.setattr(triton_delta, "_delta_step_kernel", recorder)
    with torch.inference_mode(), OpTrace() as entry:
        triton_delta.gated_delta_step(*inputs, pool.clone(), slots)
    monkeypatch.undo()  # torch.Tensor's methods back before the assertions format anything
    assert whole.host_reads == [] and whole.device_copies == [] and torch.equal(actual, expected)
    assert entry.host_reads == [] and entry.device_copies == []
    assert recorder.launches == [((3, 4, 2), {"KEY_DIM": 16, "BLOCK_V": 16})]


def test_the_loaders_self_check_passes_the_kernel_and_fails_a_wrong_one():
    """gpu.delta_step_kernel's check (triton_check.delta_step_check, an fp64 reference written from the definition)
    passes this kernel in the interpreter and names a kernel that forgets the decay."""
    from oval_edge.kernels.triton_kernels import triton_check

    assert triton_check.delta_step_check(triton_delta, torch.device("cpu")) is None

    class NoDecay:
        @staticmethod
        def gated_delta_step(q, k, v, g, beta, states, slots):
            return triton_delta.gated_delta_step(q, k, v, torch.zeros_like(g), beta, states, slots)

    assert "gated_delta_step" in triton_check.delta_step_check(NoDecay, torch.device("cpu"))
