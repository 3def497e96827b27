"""One static step's attention, layer by layer (static_step.py builds the step and its inputs; this runs its layers'
attention over them): write the rows' K/V, select pages in sparse layers from their scores, attend.

Which scorer reads a sparse layer's records is fixed when the step is built (StaticStep): a bound native scorer
(CPU), the Triton kernels (CUDA), or the torch ops of PackedScorer; the tensors they read besides the pool (the
int4 record's rotation, byte tables) are built then too, so a step never rebuilds them.
"""

from __future__ import annotations

import torch

from oval_edge.kv.page_record import layer_records
from oval_edge.kv.ring import ring_row
from oval_edge.sparse.grouped import grouped_scores, uses_groups
from oval_edge.sparse.scoring import group_queries, score_pages
from oval_edge.sparse.selection import DecodePlan
from oval_edge.sparse.sliding import ring_slots
from oval_edge.sparse.step_ops import attend_slots, page_scores, select_slots, write_kv


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
        config = self.runner.config
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
        if ops.qk_norm is not None or not ops.rope or torch.compiler.is_compiling() or pool.device.type == "cpu":
            return None
        slots = self.ring_slots if step.sliding[index] else self.slots
        hq, hkv, d = runner.num_heads, runner.kv_heads, runner.head_dim
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

    def __call__(self, index: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None) -> torch.Tensor:
        """q [B, Hq, D], k, v [B, Hkv, D] (None: rope_write stored them) -> out [B, Hq, D]."""
        step, plan = self.step, self.plan
        q = q.contiguous()  # a slice of the fused q|k heads: copied once here, not by the scorer and the attention
        if step.sliding[index]:
            if k is not None:
                write_kv(self.pool, index, self.ring_slots, k, v)
            flat, valid = self.ring
            return attend_slots(self.pool, index, q, flat, valid, None, self.runner.scale, self.runner.softcap)
        if k is not None:
            write_kv(self.pool, index, self.slots, k, v)
        if step.dense[index]:
            dense = plan.full_dense()
            flat, valid, limits = dense.flat, dense.valid, step.lengths  # row b reads its first lengths[b] slots
        else:
            flat, valid, window = select_slots(plan, self._scores(index, q), step.sealed)
            limits = None
            self.valids.append(valid)
            self.windows.append(window)
        return attend_slots(self.pool, index, q, flat, valid, limits, self.runner.scale, self.runner.softcap)

    def _scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Page scores [B, Hkv, W] of one sparse layer from the records (pages past `sealed` are not candidates)."""
        runner, step = self.runner, self.step
        grouped = group_queries(q, runner.kv_heads)  # [B, Hkv, G, D]
        scorer = None if torch.compiler.is_compiling() else step.scorers[layer]
        if scorer is not None:
            scores = scorer(grouped, step.page_table, step.sealed, runner.scale)
            if scores is not None:
                return scores
        config = runner.config
        if config.scorer == "oval" and uses_groups(step.page_table.shape[1], config.group_pages, config.top_groups):
            return grouped_scores(grouped, self.pool.summaries, self.pool.paged_index[layer], step.page_table,
                                  step.sealed, runner.scale, config.group_pages, config.top_groups,
                                  lambda table, n: self._fine_scores(layer, grouped, table, n))
        if config.scorer == "oval":
            return self._fine_scores(layer, grouped, step.page_table, step.sealed)
        return score_pages(runner.config.scorer, grouped, self.pool.summaries, layer, step.page_table, runner.scale)

    def _fine_scores(self, layer: int, grouped: torch.Tensor, table: torch.Tensor,
                     counts: torch.Tensor) -> torch.Tensor:
        """oval scores [B, Hkv, F] of grouped [B, Hkv, G, D] over table [B, F] (pages past counts[b] are no
        candidates) from the layer's records: Triton with the step's rotation, PackedScorer, or page_scores."""
        step, scale = self.step, self.runner.scale
        if not torch.compiler.is_compiling() and (step.triton is not None or step.record_scorer is not None):
            records = layer_records(self.pool.summaries, self.pool.paged_index[layer])
            if step.triton is not None:
                scores = step.triton.oval_scores(grouped, records, table, scale, counts, step.rotation)
                if scores is not None:
                    return scores
            elif step.record_scorer.takes(records):
                return step.record_scorer(grouped, records, table)
        return page_scores(self.pool, layer, grouped, table, counts, scale)

    def stats(self) -> torch.Tensor:
        """[attended slots, window sum, window count] over the real rows, on the device (no sync)."""
        step, valids, windows = self.step, self.valids, self.windows
        real = step.real
        attended = (step.lengths * real).sum() * (step.dense_layers * self.runner.kv_heads)
        if self.ring is not None:  # each sliding layer attends to the ring's valid slots
            attended = attended + (self.ring[1].sum((1, 2)) * real).sum() * step.sliding_layers
        window_sum = window_count = torch.zeros((), dtype=torch.long, device=real.device)
        if valids:
            attended = attended + (torch.stack(valids).sum((0, 2, 3)) * real).sum()
            sparse = (self.plan.sparse_rows.long() * real)[None, :, None]  # [1, B, 1]
            window_sum = (torch.stack(windows) * sparse).sum()
            window_count = sparse.sum() * (len(windows) * self.runner.kv_heads)
        return torch.stack([attended, window_sum, window_count])
