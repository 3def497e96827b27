"""The static step's fewer-launch forms compute what the ops they replace compute (the GPU decode step takes them;
tests/test_fake_cuda_step.py counts its launches): RoPE as one batched matmul by per-token rotation matrices, a
norm with a 16-bit weight as one F.rms_norm, and K/V written from strided slices through [N, Hkv] slots."""

from __future__ import annotations

import pytest
import torch

from oval_edge.runtime.engine.forward.layer_ops import one_op_norm
from oval_edge.runtime.engine.forward.paged_llama import _rotate, _signed_sin
from oval_edge.runtime.engine.forward.static_attention import rotation_matrices
from oval_edge.runtime.model.decoder import RMSNorm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_rotation_matrices_rotate_as_rope(dtype, tol):
    generator = torch.Generator().manual_seed(0)
    n, heads, dim = 4, 12, 64
    freqs = torch.tensor([0, 3, 900, 8000])[:, None].float() * (10000.0 ** (-torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, D]
    cos, sin = emb.cos().to(dtype), _signed_sin(emb.sin().to(dtype))
    x = torch.randn(n, heads, dim, generator=generator).to(dtype)
    got = torch.matmul(x, rotation_matrices(cos, sin))
    want = _rotate(x, cos, sin)
    error = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)
    assert float(error.max()) <= tol  # fp32: the same two products, summed once; bf16: one rounding apart


def test_one_op_norm_is_the_modules_arithmetic():
    generator = torch.Generator().manual_seed(1)
    module = RMSNorm(torch.randn(576, generator=generator).to(torch.bfloat16), 1e-5)
    norm = one_op_norm(module)
    x = torch.randn(5, 576, generator=generator) * 3
    assert torch.equal(norm(x), module(x))  # fp32 activations: exactly
    x16 = x.to(torch.bfloat16)
    got, want = norm(x16).float(), module(x16).float()
    assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= 2 ** -7  # one bf16 rounding apart
    assert one_op_norm(torch.nn.LayerNorm(576)) is None  # not an RMSNorm: the module's own forward


def test_write_kv_takes_strided_heads_through_per_head_slots():
    from oval_edge import OvalConfig
    from oval_edge.geometry import KVGeometry
    from oval_edge.kv.pool import PagePool
    from oval_edge.sparse.step_ops import write_kv

    geometry = KVGeometry.for_oval(2, 3, 16, OvalConfig(page_size=16, rank=4), "float32")
    pools = [PagePool(geometry, 4, "cpu") for _ in range(2)]
    projection = torch.randn(2, 9 * 16)  # [n, (Hq + 2 Hkv) * D] with Hq = 3, Hkv = 3
    k, v = projection[:, 48:96].view(2, 3, 16), projection[:, 96:].view(2, 3, 16)  # strided slices
    slots = torch.tensor([[0, 16, 32], [49, 65, 81]])
    write_kv(pools[0], 1, slots, k, v)  # index_put_ of the slices
    pools[1].write_rows(1, slots.reshape(-1), k, v)  # the pool's own write (copies them flat first)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    assert pools[0].k[1].abs().sum() > 0
