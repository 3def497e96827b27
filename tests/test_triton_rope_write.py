"""The static step's fused RoPE + K/V write (triton_attention.rope_write, one launch per layer on CUDA) against the
torch ops it replaces (PagedLlama.split_qkv's rotation, then the pool write), in Triton's interpreter on CPU
tensors: activations fp32 and bf16, a pool in another dtype, a projection output with a row stride of its own.
Tolerance: one rounding of the output dtype (the kernel and torch may fuse the multiply-add differently)."""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import TOL, _near, gpu  # its import sets up the interpreter

from oval_edge.runtime.engine.forward.paged_llama import _rotate, _signed_sin

HEADS, KV_HEADS, DIM = 9, 3, 64


def _case(act: torch.dtype, rows: int, generator: torch.Generator):
    n = 3
    width = (HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(n, width + 40, generator=generator).to(act)[:, :width]  # row stride width + 40
    positions = torch.tensor([5, 1000, 77])
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(0, DIM, 2).float() / DIM))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(act)[:, None, :], _signed_sin(emb.sin().to(act)[:, None, :])  # [n, 1, D]
    slots = torch.randperm(rows, generator=generator)[: n * KV_HEADS].view(n, KV_HEADS)
    return qkv, cos.contiguous(), sin.contiguous(), slots


@pytest.mark.parametrize("act,pool", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                      (torch.float32, torch.bfloat16)])
def test_rope_write_rotates_q_and_k_and_stores_k_and_v_as_the_torch_ops(act, pool, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the loader offers the kernels for CPU tensors only in the interpreter
    generator = torch.Generator().manual_seed(0)
    rows = 96
    qkv, cos, sin, slots = _case(act, rows, generator)
    kernels = gpu.gpu_kernels(torch.device("cpu"))
    assert kernels is not None
    k_rows, v_rows = torch.randn(rows, DIM, generator=generator).to(pool), torch.randn(rows, DIM).to(pool)
    want_k, want_v = k_rows.clone(), v_rows.clone()
    n = qkv.shape[0]
    qk = _rotate(qkv[:, : (HEADS + KV_HEADS) * DIM].reshape(n, HEADS + KV_HEADS, DIM), cos, sin)
    want_k[slots.reshape(-1)] = qk[:, HEADS:].reshape(-1, DIM).to(pool)
    want_v[slots.reshape(-1)] = qkv[:, (HEADS + KV_HEADS) * DIM:].reshape(-1, DIM).to(pool)
    q = kernels.rope_write(qkv, cos, sin, HEADS, KV_HEADS, slots, k_rows, v_rows)
    assert q.shape == (n, HEADS, DIM) and q.dtype == act and q.is_contiguous()
    _near(q, qk[:, :HEADS], TOL[act])
    _near(k_rows, want_k, TOL[pool])
    _near(v_rows, want_v, TOL[pool])  # values stored unrotated (the interpreter's fp32 -> bf16 cast may truncate)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots.reshape(-1)] = False
    assert torch.equal(k_rows[untouched], want_k[untouched])


def test_rope_write_declines_what_it_cannot_take(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(1)
    qkv, cos, sin, slots = _case(torch.float32, 96, generator)
    kernels = gpu.gpu_kernels(torch.device("cpu"))
    rows = torch.zeros(96, DIM)
    assert kernels.rope_write(qkv, cos, sin, HEADS, KV_HEADS, slots.t().contiguous().t(), rows, rows.clone()) is None
    assert kernels.rope_write(qkv, cos[..., : DIM // 2].contiguous(), sin, HEADS, KV_HEADS, slots, rows,
                              rows.clone()) is None  # partial rotary (Phi-4-mini): the torch ops rotate
