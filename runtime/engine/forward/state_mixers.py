"""The per-layer math of the state mixers: the gated delta rule of Qwen3.5's Gated DeltaNet layers, the causal
depthwise conv in front of it (and LFM2's short conv), and the gated RMSNorm after it, as plain torch functions over
state tensors the page pool owns.

The pool allocates the states once ([R-pool]); these functions read them and write them back in place, and never
allocate a state of their own. Prefill functions take one sequence's state; the decode steps take the pool's whole
tensor and a `slots` row per batch row, gathered and written back with one index op each, so a static step
([R-static-step]) traces them whole: no host sync, no shape that depends on a value.

All arithmetic is fp32; results come back in the input's dtype. The recurrent state is fp32 (its rank-one updates
accumulate over the whole sequence); the conv state keeps the dtype the pool gave it (it holds inputs, not sums).

The gated delta rule, per value head, with the state S [dk, dv], a key k and query q [dk] (L2-normalised, q scaled
by dk**-0.5), a value v [dv], the log decay g <= 0 and the write strength beta in (0, 1):

    S <- exp(g) * S                       decay what was stored
    S <- S + k (beta * (v - k^T S))^T     write v under k, replacing what k read before (the delta rule)
    o  = q^T S                            read with q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the rsqrt of the q/k L2 norm, as the reference kernels (FLA, transformers) put it


# ---- causal depthwise conv (Qwen3.5's q|k|v conv, LFM2's short conv) ----------------------------------------------

def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = False) -> torch.Tensor:
    """One sequence's new tokens through a causal depthwise conv whose history is `state`.

    x [n, C] (n >= 1); state [C, K-1]: the K-1 inputs before x (zeros for a fresh sequence), overwritten with the
    K-1 inputs ending at x's last token; weight [C, K] (tap K-1 meets the newest input); bias [C] or None.
    Returns out [n, C] in x's dtype: out[t, c] = bias[c] + sum_j weight[c, j] * input[t - (K-1) + j, c], then silu.
    """
    _check_conv(x, state, weight, "causal_conv", "x [n, C]", "state [C, K-1]")
    taps = weight.shape[1]
    history = taps - 1
    window = torch.cat([state.float().t(), x.float()], dim=0)  # [K-1 + n, C]: the history, then the new inputs
    out = F.conv1d(window.t().unsqueeze(0), weight.float().unsqueeze(1), _fp32(bias), groups=weight.shape[0])
    out = out[0].t()  # [n, C]: a valid conv over K-1 + n inputs gives exactly n outputs
    if history:
        state.copy_(window[window.shape[0] - history:].t())
    return (F.silu(out) if silu else out).to(x.dtype)


def causal_conv_step(x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """One decode token per row through the causal depthwise conv, each row's history a row of the pool's tensor.

    x [B, C]; states [S, C, K-1] (the pool's); slots [B] int64, each row's state row. Rows may share a slot only
    when they carry the same input (a static step's padding rows repeat row 0): the new state is those inputs
    shifted in, so every write to a shared slot writes the same bits. Returns out [B, C] in x's dtype.
    """
    _check_conv(x, states[0], weight, "causal_conv_step", "x [B, C]", "states [S, C, K-1]")
    history = states.index_select(0, slots)  # [B, C, K-1], contiguous
    wide, newest = weight.float(), x.float()
    # Tap by tap over [B, C] slices rather than one product and sum over a [B, C, K] window: the window's last dim
    # of 3-4 makes every op strided (measured 39 us against 70 us at C = 6144 on a CPU).
    out = newest * wide[:, -1] if bias is None else newest * wide[:, -1] + bias.float()
    for tap in range(weight.shape[1] - 1):
        out = out + history[:, :, tap].float() * wide[:, tap]
    shifted = torch.cat([history[:, :, 1:], x.unsqueeze(-1).to(states.dtype)], dim=-1)  # [B, C, K-1]
    states.index_copy_(0, slots, shifted)
    return (F.silu(out) if silu else out).to(x.dtype)


# ---- the gated delta rule ------------------------------------------------------------------------------------------

def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """One sequence's new tokens through the gated delta rule, `chunk` tokens at a time in the chunked (UT) form.

    q, k [n, Hk, dk]; v [n, Hv, dv]; g, beta [n, Hv] (g the log decay, <= 0); state [Hv, dk, dv] fp32, overwritten
    with the state after the last token. Hv is a multiple of Hk: k head h serves v heads h*r .. h*r + r-1 (r =
    Hv/Hk). q and k are L2-normalised here and q scaled by dk**-0.5. Returns out [n, Hv, dv] in v's dtype.

    Why chunked: token by token is n dependent [dk, dv] updates per head; within a chunk of L tokens the updates
    fold into a few [L, L] and [L, d] matmuls, and only the chunk-to-chunk scan stays sequential.
    """
    if chunk < 1:
        raise ValueError(f"gated_delta_prefill: chunk must be >= 1 tokens, got {chunk}")
    n, heads, key_dim, value_dim = _check_delta(q, k, v, g, beta, state, "gated_delta_prefill", pooled=False)
    out_dtype = v.dtype
    # Pad to whole chunks with k = v = 0, beta = 0, g = 0: a padded token writes nothing and decays nothing, so the
    # state after the last chunk is the state after the last real token.
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    q, k = (F.pad(_per_value_head(t, heads), (0, 0, 0, 0, 0, pad)) for t in _normalised(q, k))  # [m*L, Hv, dk]
    v = F.pad(v.float(), (0, 0, 0, 0, 0, pad))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)) for t in (g, beta))
    # -> [Hv, m, L, d] and [Hv, m, L], contiguous: every matmul below then reads whole rows.
    q, k, v = (t.view(chunks, chunk, heads, -1).permute(2, 0, 1, 3).contiguous() for t in (q, k, v))
    g, beta = (t.view(chunks, chunk, heads).permute(2, 0, 1).contiguous() for t in (g, beta))

    # Within a chunk, with S0 the state at its start and c_t the cumulative log decay up to token t (inclusive):
    #   S_t = exp(c_t) S0 + sum_{s <= t} exp(c_t - c_s) k_s u_s^T
    # where u_s, the value token s actually writes, solves the unit lower-triangular system (I + A) u = r,
    #   u_t + sum_{s < t} beta_t exp(c_t - c_s) (k_t . k_s) u_s = beta_t v_t - beta_t exp(c_t) k_t^T S0,
    # so u = U - W S0 with U, W from (I + A)^-1, which does not need S0 (the UT transform). The inverse [L, L] is
    # one triangular solve against I, then two matmuls: 1.6x faster on a CPU than solving for the [L, dv + dk]
    # right-hand sides directly (the solver copies them to column-major first).
    cum = g.cumsum(-1)  # [Hv, m, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gaps = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
    decay_between = gaps.exp()  # [Hv, m, L, L]: exp(c_t - c_s) for s <= t, else 0 (the -inf keeps exp bounded)
    mixing = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay_between  # its strict lower part is A
    identity = torch.eye(chunk, dtype=torch.float32, device=q.device).expand_as(mixing)
    inverse = torch.linalg.solve_triangular(mixing, identity, upper=False, unitriangular=True)  # (I + A)^-1
    written = inverse @ (v * beta.unsqueeze(-1))  # U [Hv, m, L, dv]
    from_state = inverse @ (k * (beta * cum.exp()).unsqueeze(-1))  # W [Hv, m, L, dk]

    # Token t's output is q_t^T S_t = exp(c_t) q_t^T S0 + sum_{s <= t} q_t . k_s exp(c_t - c_s) u_s; with u = U - W S0
    # that is (attend U)_t + (exp(c_t) q_t - (attend W)_t)^T S0: everything but the S0 products is batched over
    # the chunks here, so the scan does three matmuls a chunk.
    attend = (q @ k.transpose(-1, -2)) * decay_between  # [Hv, m, L, L]: q_t . k_s exp(c_t - c_s), s <= t
    out = attend @ written  # [Hv, m, L, dv]: the chunk's own writes; each chunk's S0 part is added in the scan
    reader = q * cum.exp().unsqueeze(-1) - attend @ from_state  # [Hv, m, L, dk]: how each token reads S0
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # what u_s still weighs at the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, m, 1, 1]

    running = state.float()  # [Hv, dk, dv]
    for i in range(chunks):
        out[:, i] += reader[:, i] @ running
        u = written[:, i] - from_state[:, i] @ running  # [Hv, L, dv]
        running = running * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    state.copy_(running)
    return out.view(heads, chunks * chunk, value_dim)[:, :n].transpose(0, 1).to(out_dtype)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row through the gated delta rule, each row's state a row of the pool's tensor.

    q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; states [S, Hv, dk, dv] fp32 (the pool's); slots [B] int64
    (rows may repeat as in causal_conv_step: a padding row computes its row 0's state to within rounding, since a
    vectorised kernel may round a row differently by where it sits, and index_copy_ keeps one of the copies).
    Returns out [B, Hv, dv] in v's dtype.

    Both reads come from the decayed old state, so the state is read once for them and written once:
    k^T S' = exp(g) k^T S and q^T S'' = exp(g) q^T S + (q . k) delta, where S'' = exp(g) S + k delta^T.
    """
    _, heads, _, _ = _check_delta(q, k, v, g, beta, states, "gated_delta_step", pooled=True)
    out_dtype = v.dtype
    q, k = (_per_value_head(t, heads) for t in _normalised(q, k))  # [B, Hv, dk]
    decay = g.float().exp().unsqueeze(-1)  # [B, Hv, 1]
    stored = states.index_select(0, slots)  # [B, Hv, dk, dv], a copy: updated in place below, then written back
    reads = torch.stack([q, k], dim=2) @ stored  # [B, Hv, 2, dv]: q^T S and k^T S
    delta = beta.float().unsqueeze(-1) * (v.float() - decay * reads[:, :, 1])  # [B, Hv, dv]
    out = decay * reads[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta
    # One multiply and one broadcast multiply-add over the gathered copy (baddbmm_ with a rank-one product measured
    # 1.6x slower on a CPU: a GEMM call per head for a single multiply-add per element).
    stored.mul_(decay.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    states.index_copy_(0, slots, stored)
    return out.to(out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm over the delta rule's output: weight * x / rms(x) * silu(gate), all in fp32.

    x, gate [..., dv]; weight [dv] (the scale itself, not 1 + w). Returns [..., dv] in x's dtype. (transformers
    rounds x / rms(x) to x's dtype before the weight; in fp32 the two are the same, in bf16 within one rounding.)
    """
    if x.shape != gate.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm: x {list(x.shape)} and gate {list(gate.shape)} must match and weight "
                         f"{list(weight.shape)} must be [{x.shape[-1]}] (one scale per channel of a head)")
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * F.silu(gate.float())).to(x.dtype)


# ---- helpers -------------------------------------------------------------------------------------------------------

def _normalised(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., dk] -> fp32, each L2-normalised over dk (eps inside the rsqrt) and q scaled by dk**-0.5."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
    return q, k


def _per_value_head(t: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[rows, Hk, d] -> [rows, Hv, d]: k head h repeated for the Hv/Hk consecutive v heads it serves."""
    key_heads = t.shape[1]
    return t if key_heads == value_heads else t.repeat_interleave(value_heads // key_heads, dim=1)


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _check_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, name: str, x_shape: str,
                state_shape: str) -> None:
    """Shapes only (plain ints: free under tracing, never a device read)."""
    if x.dim() != 2 or weight.dim() != 2 or state.dim() != 2:
        raise ValueError(f"{name}: expected {x_shape}, {state_shape} and weight [C, K]; got x {list(x.shape)}, "
                         f"a state row {list(state.shape)}, weight {list(weight.shape)}")
    channels, taps = weight.shape
    if x.shape[1] != channels or tuple(state.shape) != (channels, taps - 1):
        raise ValueError(f"{name}: weight [C={channels}, K={taps}] needs x [.., {channels}] and a state row "
                         f"[{channels}, {taps - 1}]; got x {list(x.shape)} and {list(state.shape)} (a state holds "
                         f"the last K-1 inputs of each channel)")


def _check_delta(q, k, v, g, beta, state, name: str, pooled: bool) -> tuple[int, int, int, int]:
    """-> (rows, Hv, dk, dv) after checking every shape against q's and v's (plain ints, trace-safe). `state` is
    the pool's [S, Hv, dk, dv] (pooled) or one sequence's [Hv, dk, dv]."""
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{name}: expected q, k [n, Hk, dk] and v [n, Hv, dv]; got q {list(q.shape)}, v "
                         f"{list(v.shape)} (one row per token, heads split out)")
    rows, key_heads, key_dim = q.shape
    _, heads, value_dim = v.shape
    if k.shape != q.shape or v.shape[0] != rows or g.shape != (rows, heads) or beta.shape != (rows, heads):
        raise ValueError(f"{name}: expected q, k [n, Hk, dk], v [n, Hv, dv], g and beta [n, Hv]; got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta "
                         f"{list(beta.shape)}")
    if heads % key_heads:
        raise ValueError(f"{name}: {heads} value heads is not a multiple of {key_heads} key heads (each key head "
                         "serves Hv/Hk consecutive value heads)")
    state_shape = "states [S, Hv, dk, dv]" if pooled else "state [Hv, dk, dv]"
    if state.dim() != (4 if pooled else 3) or tuple(state.shape[-3:]) != (heads, key_dim, value_dim) or state.dtype != torch.float32:
        raise ValueError(f"{name}: expected {state_shape} with [Hv, dk, dv] = [{heads}, {key_dim}, {value_dim}] in "
                         f"fp32, got {list(state.shape)} {state.dtype} (the recurrent state is kept in fp32)")
    return rows, heads, key_dim, value_dim
