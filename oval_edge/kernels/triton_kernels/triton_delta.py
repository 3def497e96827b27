"""One decode step of the gated delta rule (Qwen3.5's Gated DeltaNet) on CUDA in Triton, each row's recurrent state
read once and written once, in place in the pool's tensor.

Why: the torch step (runtime/engine/forward/state_mixers.py `gated_delta_step`, the reference) gathers the rows'
states [B, Hv, dk, dv] fp32 into a copy, reads it with a matmul, updates it with two elementwise passes and scatters
it back: five passes over 1 MiB a row at Qwen3.5-0.8B's shapes. Here a program loads a [dk, BLOCK_V] tile of one
row's state for one value head, computes both reads and the update from registers and stores the tile back where
it came from: one read and one write of the state.

Per row b, value head h (key head h // (Hv / Hk)), with q, k L2-normalised (eps inside the square root) and q scaled
by dk**-0.5, the tile S [dk, BLOCK_V] of that row's state:
    delta = beta * (v - exp(g) k^T S)          out = exp(g) q^T S + (q . k) delta
    S <- exp(g) S + k delta^T
all in fp32 whatever the inputs' dtype; out is stored in v's dtype.

Rows sharing a slot (a static step's padding rows repeat row 0 with its input): the tile is updated in place, so a
second program on the same slot could read a tile the first already wrote. Only the first row of each slot (the
`lead` the wrapper computes from the slots on the device) reads and writes the state; the others take that row's
output. The contract is the torch step's: rows sharing a slot carry the same input.

Capturable: the output is allocated from the tensor shapes, the grid and block sizes come from shapes only, and
nothing is read back to the host (the static step is captured into CUDA graphs). Not wired into the runtime: a
kernel the step may choose once it is measured on the device (oval_edge/kernels/gpu.py's loader would offer it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import SUM

L2_EPS = 1e-6  # the reference's: inside the square root of the q/k norms
BLOCK_V = 16  # value columns per program: a [dk, 16] fp32 tile (8 KB at dk = 128); B x Hv x dv/16 programs
MAX_KEY_DIM = 256  # the whole key dim is one tile axis: dk up to this, a power of two
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # q, k, v (and g, beta) dtypes on CUDA
# Triton's interpreter (CPU tensors, the tests) mis-handles bf16 (see triton_int8_head.py): declined there, checked
# on the device only.
INTERPRETED_DTYPES = (torch.float16, torch.float32)


@triton.jit
def _delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, lead_ptr, out_ptr,
                       key_heads, value_heads, value_dim, eps, scale,
                       KEY_DIM: tl.constexpr, BLOCK_V: tl.constexpr):
    """Axis 0: the batch row; axis 1: the value head; axis 2: BLOCK_V columns of dv.

    q, k [B, Hk, KEY_DIM]; v [B, Hv, dv]; g, beta [B, Hv]; states [S, Hv, KEY_DIM, dv] fp32; slots, lead [B] int64;
    out [B, Hv, dv] in v's dtype (written for lead rows only)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims = tl.arange(0, KEY_DIM)
    # The first row with this slot is the only one touching it: the others see no columns at all.
    cols_ok = cols < tl.where(tl.load(lead_ptr + row) == row, value_dim, 0)

    key_at = (row * key_heads + head // (value_heads // key_heads)).to(tl.int64) * KEY_DIM + dims
    q = tl.load(q_ptr + key_at).to(tl.float32)
    k = tl.load(k_ptr + key_at).to(tl.float32)
    q = q * (scale / tl.sqrt(tl.reduce(q * q, 0, SUM) + eps))
    k = k / tl.sqrt(tl.reduce(k * k, 0, SUM) + eps)

    row_head = row.to(tl.int64) * value_heads + head
    decay = tl.exp(tl.load(g_ptr + row_head).to(tl.float32))
    beta = tl.load(beta_ptr + row_head).to(tl.float32)
    v = tl.load(v_ptr + row_head * value_dim + cols, mask=cols_ok, other=0.0).to(tl.float32)  # [BLOCK_V]

    slot = tl.load(slots_ptr + row).to(tl.int64)
    tile = states_ptr + ((slot * value_heads + head) * KEY_DIM + dims[:, None]) * value_dim + cols[None, :]
    state = tl.load(tile, mask=cols_ok[None, :], other=0.0)  # [KEY_DIM, BLOCK_V] fp32
    read_q = tl.reduce(q[:, None] * state, 0, SUM)  # [BLOCK_V]: q^T S
    read_k = tl.reduce(k[:, None] * state, 0, SUM)  # k^T S
    delta = beta * (v - decay * read_k)
    out = decay * read_q + tl.reduce(q * k, 0, SUM) * delta
    tl.store(tile, state * decay + k[:, None] * delta[None, :], mask=cols_ok[None, :])
    tl.store(out_ptr + row_head * value_dim + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """The torch step's contract (state_mixers.gated_delta_step): q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv];
    states [S, Hv, dk, dv] fp32, updated in place; slots [B] int64 -> out [B, Hv, dv] in v's dtype. None for inputs
    the kernel does not take (a dtype or device it does not run, dk not a power of two up to MAX_KEY_DIM, shapes
    that do not match, non-contiguous tensors), so the caller runs the torch step."""
    dtypes = DTYPES if q.device.type == "cuda" else INTERPRETED_DTYPES
    tensors = (q, k, v, g, beta, states, slots)
    if (q.dim() != 3 or v.dim() != 3 or states.dim() != 4 or slots.dim() != 1
            or any(t.dtype not in dtypes for t in (q, k, v, g, beta)) or states.dtype != torch.float32
            or slots.dtype != torch.int64 or any(t.device != q.device for t in tensors)
            or not all(t.is_contiguous() for t in tensors)):
        return None
    rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    if (k.shape != q.shape or v.shape[0] != rows or g.shape != (rows, value_heads) or beta.shape != g.shape
            or slots.shape != (rows,) or states.shape[1:] != (value_heads, key_dim, value_dim)
            or value_heads % key_heads or key_dim > MAX_KEY_DIM or key_dim & (key_dim - 1)):
        return None
    out = torch.empty_like(v)
    if rows == 0:
        return out
    # lead[b]: the first row with b's slot (argmax returns the first of equal maxima), from the slots on the device.
    lead = (slots[None, :] == slots[:, None]).to(torch.int32).argmax(dim=1)
    grid = (rows, value_heads, triton.cdiv(value_dim, BLOCK_V))
    _delta_step_kernel[grid](q, k, v, g, beta, states, slots, lead, out, key_heads, value_heads, value_dim,
                             L2_EPS, key_dim ** -0.5, KEY_DIM=key_dim, BLOCK_V=BLOCK_V)
    return out.index_select(0, lead)  # rows sharing a slot take its first row's output
