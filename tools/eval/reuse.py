"""Selection reuse in `oval-edge eval`: rows of the oval policy with a `reuse_tau` (`--reuse-tau 0.9,0.95,0.99`).

Such a row decodes exactly as a plain oval row of its budget (it sits in the same scored group and is scored by
the same scorer) except that, in a layer where every KV head's query matched a recent selection of that row
(oval_edge/sparse/reuse.py), its page scores are replaced by the reused pages. Each row has its own SelectionReuse, so
its hit rate is its own. The eval is not timed: rows that hit are still scored (and the scores thrown away),
which keeps the hook to two calls in EvalRunner.decode_rows.
"""

from __future__ import annotations

from typing import Sequence

import torch

from oval_edge.sparse.reuse import ReuseCounts, SelectionReuse


class EvalReuse:
    """Per eval row with a reuse_tau: its SelectionReuse and its position inside its row group.

    groups: EvalRunner.groups (each with `row_list` and `config`); policies: one per batch row.
    """

    def __init__(self, groups: Sequence, policies: Sequence, layers: int, q_heads: int, kv_heads: int,
                 head_dim: int, device) -> None:
        self.rows: dict[int, SelectionReuse] = {}
        self.by_group: dict[int, list[tuple[int, SelectionReuse]]] = {}  # id(group) -> [(position, state)]
        for group in groups:
            for pos, row in enumerate(group.row_list):
                tau = getattr(policies[row], "reuse_tau", None)
                if tau is None:
                    continue
                config = group.config.replace(reuse_tau=tau)
                if config.window_min != config.window_max:
                    raise ValueError(f"reuse rows need a fixed window, got [{config.window_min}, "
                                     f"{config.window_max}] for {policies[row].label}")
                state = SelectionReuse.for_model(config, layers, q_heads, kv_heads, head_dim, device)
                self.rows[row] = state
                self.by_group.setdefault(id(group), []).append((pos, state))

    def apply(self, group, layer: int, sub, plan, q: torch.Tensor, scores: torch.Tensor | None) -> list:
        """Overwrite the scores [n, Hkv, Np] of this group's reuse rows that hit; returns what `record` needs."""
        pending = []
        if scores is None or plan.all_dense:
            return pending
        for pos, state in self.by_group.get(id(group), ()):
            at = slice(pos, pos + 1)
            state.bind(sub, [sub.seq_ids[pos]], [sub.lengths_list[pos]], plan.dense_rows[at])
            found = state.lookup(layer, q[at])
            if found.hit_rows:
                scores[at] = state.scores(state.cached(found)[0], scores.shape[-1])
            pending.append((pos, state, found))
        return pending

    @staticmethod
    def record(pending: list, selection) -> None:
        for pos, state, found in pending:
            at = slice(pos, pos + 1)
            state.record(found, selection.pages[at], None if selection.window is None else selection.window[at])

    def counts(self, row: int) -> ReuseCounts | None:
        state = self.rows.get(row)
        return state.counts if state is not None else None
