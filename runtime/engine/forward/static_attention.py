"""One static step's attention, layer by layer (static_step.py builds the step and its inputs; this runs its layers'
attention over them): write the rows' K/V, select pages in sparse layers from their scores, attend.

Each op's body (write, scores, select, attend) is fixed when the step is built: StaticStep.ops, the table of
oval_edge/sparse/step_ops_table.py (C on a CPU, Triton on CUDA, torch otherwise; none returns None). A step policy
(step_policy.py) may replace a sparse layer's scores and window and see its selection.
"""

from __future__ import annotations

import torch

from oval_edge.kv.ring import ring_row
from oval_edge.sparse.attention import attend_rows
from oval_edge.sparse.scoring import group_queries
from oval_edge.sparse.selection import DecodePlan
from oval_edge.sparse.sliding import ring_slots
from oval_edge.sparse.step_ops import write_kv


def rotation_matrices(cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """cos, signed_sin [n, 1, D] (the step's rotary tables) -> M [n, D, D]: a head x [D] of token i rotated is
    x @ M[i] = x cos + rotate_half(x) sin. M = diag(cos) + S diag(signed sin), S[(j + D/2) % D, j] = 1 taking x to
    x rolled by D/2 (PagedLlama's _rope). Entries are cos, sin or 0: no rounding until the matmul's own."""
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=cos.dtype, device=cos.device)
    return torch.addcmul(eye * cos, eye.roll(d // 2, dims=0), signed_sin)


class StaticAttention:
    """One static step's attention, layer by layer: write the rows' K/V, select (sparse layers), attend. Holds the
    step's plan and what its sparse layers read, for `stats()`."""

    def __init__(self, step: StaticStep) -> None:
        self.step, self.runner, self.pool = step, step.runner, step.pool
        config = step.config
        self.plan = DecodePlan(config, step.lengths, step.sealed, step.width, self.runner.kv_heads, step.page_table,
                               static=True)
        self.slots = step.write_base[:, None] + step.head_offsets  # [B, Hkv] rows this step writes
        self.ring_slots = self.ring = None
        if step.sliding_layers:  # the rows' ring rows (the same in every sliding layer) and what the rings hold
            g = self.pool.geometry
            base = ring_row(g, step.ring_base, step.positions)  # [B]
            self.ring_slots = base[:, None] + step.head_offsets  # [B, Hkv]
            self.ring = ring_slots(step.lengths, step.ring_base, g)  # flat, valid [B, Hkv, R * P]
        self._turns: dict[int, torch.Tensor] = {}  # id(cos) -> its rotation matrices (one per rotary table a step)
        self.valids: list[torch.Tensor] = []
        self.windows: list[torch.Tensor] = []

    def rope_write(self, index: int, ops, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE of the fused projection's q and k heads and the K/V write of layer `index` (PagedLlama.run_layers'
        hook) -> q [B, Hq, D] contiguous, on a GPU: with the Triton kernels one launch, else two batched matmuls
        and the writes. None where the forward's ops run: a CPU (its figures as measured), head norms, a NoPE layer,
        under tracing, and for Triton int8 K/V or a page store."""
        step, pool, runner = self.step, self.pool, self.runner
        if ops.qk_norm is not None or not ops.rope or torch.compiler.is_compiling() or pool.device.type == "cpu" \
                or step.recalls or ops.value_norm_eps:
            return None
        slots = self.ring_slots if step.sliding[index] else self.slots
        hq, hkv, d = runner.num_heads, runner.kv_heads, ops.head_dim or runner.head_dim
        if step.triton is not None and pool.scale_rows[index] is None and pool.store is None:
            return step.triton.rope_write(qkv, cos, sin, hq, hkv, slots, pool.k_rows[index], pool.v_rows[index])
        if step.triton is not None or cos.shape[-1] != d:  # partial rotary (Phi-4-mini): the forward's three ops
            return None
        # The torch ops: each head times its token's rotation matrix, one batched matmul for q and one for k (no
        # copy: the heads are strided slices of the projection) instead of three ops and a copy of q
        turn = self._turns.get(id(cos))
        if turn is None:
            turn = self._turns[id(cos)] = rotation_matrices(cos, sin)
        heads = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
        write_kv(pool, index, slots, torch.matmul(heads[:, hq : hq + hkv], turn), heads[:, hq + hkv :])
        return torch.matmul(heads[:, :hq], turn)

    def mix(self, index: int, state, x: torch.Tensor) -> torch.Tensor:
        """A hybrid's state layer (state_layer_ops.py) over the step's rows x [B, hidden], each at its state slot
        (padded rows repeat row 0: the same input at the same slot writes the same state)."""
        conv, recurrent = self.pool.states.layer(index)
        return state.step(x, conv, recurrent, self.step.state_slot)

    def __call__(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None) -> torch.Tensor:
        """q [B, Hq, D], k, v [B, Hkv, D] (None: rope_write stored them) -> out [B, Hq, D]."""
        step, plan = self.step, self.plan
        q = q.contiguous()  # a slice of the fused q|k heads: copied once here, not by the scorer and the attention
        ops = step.ops
        if self.runner.ops[index].kv_source >= 0:  # Gemma 4: reads its source layer's K/V, stored there
            k = v = None
        if step.sliding[index]:
            if k is not None:
                ops.write[index](self.ring_slots, k, v)
            flat, valid = self.ring
            return ops.attend[index](q, flat, valid, None)
        if k is not None:
            ops.write[index](self.slots, k, v)
        if step.dense[index]:
            dense = plan.full_dense()
            flat, valid, limits = dense.flat, dense.valid, step.lengths  # row b reads its first lengths[b] slots
        else:
            flat, valid, window = self._select(index, x, q)
            limits = None
            self.valids.append(valid)
            self.windows.append(window)
        if step.recalls:  # stored pages the selection names come back into the pool's recall frames first
            return self._attend_recalled(index, q, flat, valid, limits)
        return ops.attend[index](q, flat, valid, limits)

    def _select(self, index: int, x: torch.Tensor, q: torch.Tensor):
        """(flat, valid [B, Hkv, T], window [B, Hkv]) of one sparse layer: its scores (the policy's scorer or the
        step's kernels), the policy's window input (x [B, hidden]: the layer's normed input), the selection."""
        step, plan, policy = self.step, self.plan, self.step.policy
        window = policy.window(index, x, step.positions) if policy.window is not None else None
        grouped = group_queries(q, self.runner.kv_heads)  # [B, Hkv, G, D]
        if policy.scores is not None:
            scores = policy.scores(index, grouped, step.page_table, step.sealed, step.lengths)
        else:
            scores = step.ops.scores[index](grouped, step.page_table, step.sealed)
        if policy.selected is not None:
            selection = plan.select(scores, window)
            policy.selected(index, q, selection)
            return selection.flat, selection.valid, selection.window
        if window is not None:
            selection = plan.select(scores, window, detail=False)
            return selection.flat, selection.valid, selection.window
        return step.ops.select(plan, scores, step.sealed)

    def _attend_recalled(self, index: int, q: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor,
                         limits: torch.Tensor | None) -> torch.Tensor:
        """Attention of a page-store step: PagePool.readable recalls the stored pages among the valid slots into
        the layer's recall frames and maps their slots there (the step's own attention body then reads them in
        place), or reads them with the resident ones into a transient buffer (many stored pages: a dense layer)."""
        k_rows, v_rows, flat, scales = self.pool.readable(index, flat, valid)
        if k_rows is self.pool.k_rows[index]:
            return self.step.ops.attend[index](q, flat, valid, limits)
        return attend_rows(q, k_rows, v_rows, flat, valid, self.runner.scale, limits, self.runner.softcap, scales)

    def stats(self) -> torch.Tensor:
        """[attended slots, window sum, window count, attended ring slots] over the real rows, on the device (no
        sync); the ring slots (sliding layers) are among the attended ones and counted apart for their row width."""
        step, valids, windows = self.step, self.valids, self.windows
        real = step.real
        attended = (step.lengths * real).sum() * (step.dense_layers * self.runner.kv_heads)
        zero = torch.zeros((), dtype=torch.long, device=real.device)
        in_rings = zero
        if self.ring is not None:  # each sliding layer attends to the ring's valid slots
            in_rings = (self.ring[1].sum((1, 2)) * real).sum() * step.sliding_layers
            attended = attended + in_rings
        window_sum = window_count = zero
        if valids:
            attended = attended + (torch.stack(valids).sum((0, 2, 3)) * real).sum()
            sparse = (self.plan.sparse_rows.long() * real)[None, :, None]  # [1, B, 1]
            window_sum = (torch.stack(windows) * sparse).sum()
            window_count = sparse.sum() * (len(windows) * self.runner.kv_heads)
        return torch.stack([attended, window_sum, window_count, in_rings])
