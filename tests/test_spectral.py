"""oval_edge/spectral.py: the seal's eigenvectors and orthonormal bases without per-matrix solver calls on CUDA.

The CUDA path (subspace iteration + one batched <= 32 x 32 eigh; Gram-Schmidt for Q) runs here on CPU tensors
against LAPACK's exact answer, and a fake CUDA device shows which solver ops a seal dispatches there.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from oval_edge.kv.records.group_record import group_record
from oval_edge.kv.records.summaries import oval_summary
from oval_edge import spectral
from oval_edge.spectral import BATCHED_EIGH_MAX, dominant_eigenvectors, orthonormal_basis, orthonormal_columns


def key_like(n: int, tokens: int, dim: int, seed: int) -> torch.Tensor:
    """[n, tokens, dim] keys with a decaying spectrum and an offset, as attention keys have (a few directions hold
    most of the energy; RoPE pairs make neighbouring eigenvalues close)."""
    gen = torch.Generator().manual_seed(seed)
    spectrum = 0.8 ** torch.arange(dim, dtype=torch.float32)
    rotation = torch.linalg.qr(torch.randn(n, dim, dim, generator=gen)).Q
    return (torch.randn(n, tokens, dim, generator=gen) * spectrum) @ rotation + torch.randn(n, 1, dim, generator=gen)


def projector(basis: torch.Tensor) -> torch.Tensor:
    return basis @ basis.transpose(-1, -2)


@pytest.mark.parametrize("dim,rank", [(64, 8), (128, 8), (64, 16)])
def test_the_iteration_finds_the_exact_dominant_subspace(dim, rank):
    x = key_like(24, 512, dim, seed=dim + rank)
    x = x - x.mean(dim=1, keepdim=True)
    scatter = x.transpose(1, 2) @ x  # [N, D, D], as a group record's
    exact = dominant_eigenvectors(scatter, rank, iterative=False)
    found = dominant_eigenvectors(scatter, rank, iterative=True)
    assert found.shape == exact.shape == (24, dim, rank)
    torch.testing.assert_close(found.transpose(1, 2) @ found, torch.eye(rank).expand(24, rank, rank), atol=1e-5,
                               rtol=0)
    # the same subspace, and the same energy captured (what the record's bounds and scores depend on)
    assert (projector(found) - projector(exact)).norm(dim=(1, 2)).max() < 2e-3
    energy = lambda b: (b.transpose(1, 2) @ scatter @ b).diagonal(dim1=1, dim2=2).sum(-1)  # noqa: E731
    assert torch.all(energy(found) >= energy(exact) * (1 - 1e-5))
    # each direction individually (up to its sign), in order
    assert torch.all((found * exact).sum(1).abs() > 0.999)


def test_orthonormal_columns_spans_what_qr_spans_and_survives_empty_columns():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(6, 64, 8, generator=gen)
    v[1, :, 3] = 0.0  # a zero-energy direction
    v[2, :, 5] = v[2, :, 1] * 2.0  # a repeated one
    v[3] = 0.0  # a page of identical keys: nothing at all
    q = orthonormal_columns(v)
    torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(8).expand(6, 8, 8), atol=1e-5, rtol=0)
    exact = torch.linalg.qr(v).Q
    for i in (0, 4, 5):  # full-rank inputs: the same span as LAPACK's Q, column by column up to sign
        assert torch.all((q[i] * exact[i]).sum(0).abs() > 1 - 1e-5)
    assert torch.equal(orthonormal_basis(v), exact)  # the CPU keeps LAPACK's Q


def test_records_from_the_cuda_path_score_like_the_exact_ones():
    keys = key_like(16, 32, 128, seed=3)  # P = 32 < D = 128: the Gram path, then a basis of [D, r]
    values = torch.randn(16, 32, 128, generator=torch.Generator().manual_seed(4))
    mean, basis_t, coords_t = oval_summary(keys, values, 8, 0.0)
    x = keys - mean[:, None]
    rebuilt = coords_t.transpose(1, 2) @ basis_t  # the record's reconstruction of the centred keys
    exact_error = (x - rebuilt).norm() / x.norm()
    gram = x @ x.transpose(1, 2)
    top = dominant_eigenvectors(gram, 8, iterative=True)  # as a CUDA device with page_size > 32 would
    basis = orthonormal_columns(x.transpose(1, 2) @ top)
    iterative_error = (x - x @ basis @ basis.transpose(1, 2)).norm() / x.norm()
    assert abs(iterative_error - exact_error) < 1e-4


class SolverOps(TorchDispatchMode):
    """Counts the eigensolver calls by matrix size and any QR factorisation dispatched."""

    def __init__(self):
        super().__init__()
        self.eigh_sizes: list[int] = []
        self.qr = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("linalg_eigh") or name == "_linalg_eigh":
            self.eigh_sizes.append(args[0].shape[-1])
        if name in ("linalg_qr", "geqrf", "linalg_householder_product", "orgqr"):
            self.qr += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cuda", [True, False])
def test_a_seal_on_cuda_dispatches_only_batched_solver_calls(cuda, monkeypatch):
    # A CPU-only torch cannot place even a fake tensor on CUDA through every op a seal runs, so the tensors stay on
    # the CPU and the one device question spectral.py asks answers as a CUDA device would.
    monkeypatch.setattr(spectral, "solver_loops_per_matrix", lambda tensor: cuda)
    with FakeTensorMode(), SolverOps() as ops:
        group_record(torch.randn(48, 512, 64), 8)  # group records: [layers x heads, G x P, D]
        page = torch.randn(96, 32, 64)
        oval_summary(page, torch.randn(96, 32, 64), 8, 0.5, torch.randn(96, 64, 64))  # eta > 0: the D x D metric
        oval_summary(page, page, 8, 0.0)  # eta = 0: the P x P Gram, then the [D, r] basis
    assert ops.eigh_sizes, "the seal solved nothing: the check would pass vacuously"
    assert (max(ops.eigh_sizes) > BATCHED_EIGH_MAX) != cuda
    assert (ops.qr > 0) != cuda  # the CPU keeps LAPACK's QR; CUDA forms no QR (orgqr loops per matrix there)


@pytest.mark.parametrize("group_pages,eta", [(0, 0.0), (4, 0.0), (0, 0.5)])
def test_the_startup_report_times_a_seal_without_touching_the_pool(group_pages, eta):
    from oval_edge.geometry import KVGeometry
    from oval_edge.kv.pool import PagePool
    from oval_edge.kv.records.summaries import seal_cost
    from oval_edge.runtime.server.serve import describe_seal_cost

    geometry = KVGeometry(layers=3, kv_heads=2, head_dim=64, page_size=16, rank=4, group_pages=group_pages)
    pool = PagePool(geometry, 32, torch.device("cpu"), eta=eta)
    before = {name: t.clone() for name, t in pool.summaries.items()}
    cost = seal_cost(pool, repeats=2)
    assert sorted(cost) == (["group", "page"] if group_pages else ["page"])
    assert all(ms > 0 for ms in cost.values())
    assert all(torch.equal(before[name], t) for name, t in pool.summaries.items())
    line = describe_seal_cost(cost)
    assert f"{cost['page']:.2f} ms a page" in line and ("a group of pages" in line) == bool(group_pages)
