"""Dominant eigenvectors and orthonormal bases of many small matrices at once, for sealing records.

Why not always torch.linalg.eigh / qr: on CUDA, torch batches the symmetric eigensolver only up to 32 x 32
(cusolver's syevjBatched) and solves larger matrices one at a time, and a QR's Q (orgqr) is always formed one
matrix at a time, each call a synchronous solver launch. A seal covers layers x KV heads x pages matrices (a group
record's D x D scatter, D = 64..256; an eta > 0 page record's D x D metric; the page record's [D, r] basis), so on a
GPU those loops stall decode between steps. Here a CUDA device takes, for matrices above the batched size, a
subspace iteration whose only solver call is one batched eigh of a <= 32 x 32 projection, and Gram-Schmidt in
batched matrix products for Q; the CPU keeps LAPACK's exact calls (batched in-process, no launches), so every CPU
figure is unchanged.
"""

from __future__ import annotations

import torch

BATCHED_EIGH_MAX = 32  # the largest n torch's CUDA eigh solves for a whole batch in one call
ITERATIONS = 8  # subspace iterations: the error in the top-r directions shrinks like (lambda_m+1 / lambda_r)^8


def solver_loops_per_matrix(tensor: torch.Tensor) -> bool:
    """Whether torch's solvers run one matrix at a time on this tensor's device (CUDA; LAPACK on a CPU batches in
    process)."""
    return tensor.device.type == "cuda"


def iterative_on(matrix: torch.Tensor) -> bool:
    """Whether `matrix` [..., n, n] takes the subspace iteration (a CUDA tensor larger than the batched solver)."""
    return solver_loops_per_matrix(matrix) and matrix.shape[-1] > BATCHED_EIGH_MAX


def dominant_eigenvectors(matrix: torch.Tensor, rank: int, iterative: bool | None = None) -> torch.Tensor:
    """matrix [N, n, n] symmetric positive semi-definite fp32 -> its top-`rank` eigenvectors [N, n, rank], the
    largest eigenvalue's first. iterative: None = iterative_on(matrix); True/False force a path (tests)."""
    if not (iterative_on(matrix) if iterative is None else iterative):
        return torch.linalg.eigh(matrix)[1][..., -rank:].flip(-1)
    n = matrix.shape[-1]
    width = min(n, BATCHED_EIGH_MAX, max(2 * rank, rank + 8))  # oversampled: the rank-th direction converges too
    # A fixed start, the same on every device and call: seals stay deterministic.
    start = torch.randn(n, width, generator=torch.Generator().manual_seed(0)).to(matrix.device, matrix.dtype)
    basis = matrix @ start  # [N, n, width]
    for _ in range(ITERATIONS):
        basis = matrix @ _cholesky_qr(basis)
    basis = orthonormal_columns(basis)  # exactly orthonormal for the projection
    # Rayleigh-Ritz: the projected width x width problem takes the batched solver
    _, small = torch.linalg.eigh(basis.transpose(-1, -2) @ matrix @ basis)
    return basis @ small[..., -rank:].flip(-1)


def _cholesky_qr(vectors: torch.Tensor) -> torch.Tensor:
    """vectors [N, n, m] -> a well-conditioned basis of their span (Q of a Cholesky QR, batched Cholesky and
    triangular solve: no per-matrix loop). A small diagonal shift keeps a rank-deficient Gram factorable; the
    iteration only needs the span, orthonormal_columns makes the final basis exact."""
    gram = vectors.transpose(-1, -2) @ vectors  # [N, m, m]
    shift = 1e-6 * gram.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30) / gram.shape[-1]  # [N]
    gram = gram + shift[:, None, None] * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    factor = torch.linalg.cholesky_ex(gram).L  # _ex: no error check, so no host read
    return torch.linalg.solve_triangular(factor.transpose(-1, -2), vectors, upper=True, left=False)


def orthonormal_basis(vectors: torch.Tensor) -> torch.Tensor:
    """vectors [N, n, r] (r <= n) -> orthonormal columns spanning them, [N, n, r]: the Q of a QR on a CPU (LAPACK), on
    CUDA orthonormal_columns (a QR's Q is formed one matrix at a time there). The two may differ in column signs."""
    if solver_loops_per_matrix(vectors):
        return orthonormal_columns(vectors)
    return torch.linalg.qr(vectors).Q


def orthonormal_columns(vectors: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt twice over the columns of vectors [N, n, m], in batched products: column j minus its projection on
    columns < j, again (one pass leaves rounding-size overlaps), then unit length. A column with no component left (a
    zero-energy direction) becomes a unit vector orthogonal to the others, as a QR would give it: each later
    column's search space stays complete."""
    n, m = vectors.shape[-2], vectors.shape[-1]
    eye = torch.eye(n, m, dtype=vectors.dtype, device=vectors.device)
    scale = vectors.norm(dim=-2, keepdim=True).amax(dim=-1, keepdim=True)  # [N, 1, 1]
    columns: list[torch.Tensor] = []
    for j in range(m):
        column, axis = vectors[..., j : j + 1], eye[:, j : j + 1].expand_as(vectors[..., j : j + 1])
        if columns:
            done = torch.cat(columns, dim=-1)  # [N, n, j]
            column, axis = _without(column, done), _without(axis, done)
        length, axis_length = column.norm(dim=-2, keepdim=True), axis.norm(dim=-2, keepdim=True)
        # chosen per matrix with where(): no host read decides it
        columns.append(torch.where(length > 1e-6 * scale, column / length.clamp_min(1e-30),
                                   axis / axis_length.clamp_min(1e-30)))
    return torch.cat(columns, dim=-1)


def _without(column: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """column [N, n, 1] minus its projection on the orthonormal columns done [N, n, j], twice (one pass leaves
    rounding-size overlaps)."""
    for _ in range(2):
        column = column - done @ (done.transpose(-1, -2) @ column)
    return column
